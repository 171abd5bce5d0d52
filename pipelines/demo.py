"""`make demo`: the whole chain on the built-in corpus, recorded in the local Dagster instance.

After it, `make ui` shows every materialization, and `kiln audit` re-verifies the checkpoint.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import dagster as dg

from pipelines.chain import materialize_chain
from pipelines.definitions import resources
from training.lineage import audit_checkpoint, audit_exit_code, audit_report


# Megatron-style validation as the demo trains: every 50 steps and after the last, 10 batches of the blend's
# validation split (the configs leave it off: the tests' small corpora cut validation splits too small for it)
DEMO_VALIDATION = {"ops": {"training_run": {"config": {"overrides": ["kiln.training.eval_interval=50",
                                                                     "kiln.training.eval_iters=10"]}}}}


def main() -> int:
    started = time.perf_counter()
    with dg.DagsterInstance.get() as instance:
        chain = materialize_chain(instance, resources(), run_config=DEMO_VALIDATION)
    print("\n=== Kiln demo summary ===")
    for event in chain.materializations["clean_corpus"]:
        md = {k: v.value for k, v in event.metadata.items()}
        if "docs_in" in md:
            removed = ", ".join(f"{k.split('/', 1)[1]} {v}" for k, v in md.items() if k.startswith("removed/") and v)
            print(f"cleaned {event.partition:<11} {md['docs_in']:>6} docs -> {md['docs_out']:>6} with recipe "
                  f"{md['recipe']} (removed: {removed or 'none'}; why: kiln why <raw file>:<line>)")
    for event in chain.materializations["token_shards"]:
        md = {k: v.value for k, v in event.metadata.items()}
        raw = chain.metadata("raw_corpus", event.partition)
        print(f"source {event.partition:<12} {raw['docs']:>6} docs  {raw['bytes']:>10,} bytes  "
              f"{md['tokens']:>10,} tokens  ({md['tokens_per_s']:,.0f} tokens/s tokenizing)")
    run = chain.metadata("training_run")
    if "first_loss" in run:
        print(f"training: steps {run['first_step']}..{run['final_step']}, loss {run['first_loss']:.4f} -> "
              f"{run['final_loss']:.4f}, {run['tokens_per_s']:,.0f} tokens/s on {run['workers']} msrun workers")
    else:
        print("training: nothing to do (already trained to the configured steps)")
    if "final_val_loss" in run:
        print(f"validation: loss {run['final_val_loss']:.4f} (perplexity {run['final_val_ppl']:.1f}) at step "
              f"{run['validation_step']} (held-out samples of the blend's validation split)")
    checkpoint = Path(run["final_checkpoint"])
    print(f"checkpoint: {checkpoint}")
    lineage, checks = audit_checkpoint(checkpoint)
    print(audit_report(checkpoint, lineage, checks))
    print(f"demo wall time: {time.perf_counter() - started:.0f} s")
    return audit_exit_code(checks)


if __name__ == "__main__":
    sys.exit(main())
