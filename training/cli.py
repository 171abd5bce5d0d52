"""``kiln`` command line: tools that work without a Dagster instance."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _audit(args) -> int:
    from training.lineage import audit_checkpoint, audit_exit_code, audit_json, audit_report

    try:
        lineage, checks = audit_checkpoint(args.checkpoint, args.data_root)
    except (ValueError, KeyError) as exc:
        print(f"kiln audit: {exc}", file=sys.stderr)
        return 2
    render = audit_json if args.json else audit_report
    print(render(Path(args.checkpoint), lineage, checks))
    return audit_exit_code(checks)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kiln", description="Kiln pretraining pipeline tools")
    commands = parser.add_subparsers(dest="command", required=True)
    audit = commands.add_parser("audit", help="re-verify a checkpoint's lineage back to the raw files",
                                description="Exit 0: every file matches; 1: a file changed since training; "
                                            "3: nothing changed but some files were not found.")
    audit.add_argument("checkpoint", help="an iteration_XXXXXXXX checkpoint directory")
    audit.add_argument("--data-root", help="where the data root is now (default: as recorded)")
    audit.add_argument("--json", action="store_true", help="machine-readable output")
    audit.set_defaults(handler=_audit)
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
