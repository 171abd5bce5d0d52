"""`make bench` (``python -m benchmarks``): every benchmark of SUITE, each in a process of its own, then one summary
table of every figure against its target. ``python -m benchmarks --smoke`` runs each at its smallest size, as
tests/test_benchmarks_smoke.py does in the test suite. Never timed in tests: figures depend on the machine and
its load.

How a benchmark joins (the one convention; `make bench`, its summary and the smoke test then cover it):
1. a module ``benchmarks/<name>.py`` with ``run(bench: benchmarks.suite.Bench) -> None``, which measures and hands
   every figure to ``bench.report(name, value, unit, ratio, reference, target=..., watch=...)``: ``target`` the
   bound an issue or a doc states (``at_least(0.9)`` on the ratio, ``at_most(2.0, of="value")``), none where
   nothing is stated; when ``bench.smoke`` is true it runs at the smallest size that still runs every code path
   of its own (a few seconds to a minute; a compiled variant may run eagerly there, SMOKE_EAGER below), and its
   figures must still be finite numbers;
2. its name added to SUITE below, in the order `make bench` runs them;
3. a benchmark that compares timings (paired variants, or times against a bound) measures inside
   ``with LoadWatch(cores) as watch:`` (benchmarks/contention.py; ``cores``: how many the run keeps busy),
   records each variant's CPU seconds per step there (``watch.time(variant, fn)`` or ``watch.cpu(variant,
   seconds, steps)`` for what a worker measured), and passes ``watch=watch`` with every timing figure it
   reports: under competition from other processes those are printed and summarized as not valid;
4. one that launches msrun (or other multi-process work the unit tier should not wait for) is named in
   LAUNCHES_PROCESSES, so its smoke test carries the ``msrun`` marker.
Data: ``bench.shard()`` gives a tokenized built-in corpus (built once per run), ``bench.work`` a directory shared
by the run's benchmarks, ``bench.recorded(benchmark, figure)`` an earlier benchmark's figure.
"""

SUITE = ("tokenizing", "model_flops", "throughput", "compile_time", "recompute_memory", "data_index", "monitoring",
         "validation", "downstream", "pipes_streaming", "checkpoint_io", "parallel_memory", "pipeline_bubble",
         "expert_parallel", "context_parallel", "compiled_parallel", "lineage_scale", "preprocess_memory",
         "chunked_preprocess", "cleaning")
LAUNCHES_PROCESSES = {"parallel_memory", "pipeline_bubble", "expert_parallel", "context_parallel",
                      "compiled_parallel"}


def blend_settings() -> list[str]:
    """Overrides giving a shipped training YAML, which leaves seq_length, split and seed to the blend manifest,
    the values blend_manifest's defaults (assets/data.py BlendConfig) would wire in."""
    from assets.data import BlendConfig

    blend = BlendConfig()
    data = "train_dataset.dataloader.config"
    return [f"{data}.seq_length={blend.seq_length}", f"model.seq_length={blend.seq_length}",
            f"{data}.split='{blend.split}'", f"{data}.seed={blend.seed}"]


# a smoke run's batch in one process: 2 samples in one micro-batch
SMOKE_BATCH = ["training.local_batch_size=2", "training.global_batch_size=2"]
# and its step eager, where what the benchmark measures does not depend on compiling (compiling a step costs 7-14
# CPU-s even at one layer: what compile_time measures)
SMOKE_EAGER = "fast_step.compile=false"
SMOKE_STEP = [*SMOKE_BATCH, SMOKE_EAGER]
# The msrun benchmarks that pair compiled layouts with eager ones train every variant eagerly in a smoke run,
# SMOKE_EAGER given last: there each compiled variant costs a compile per rank, most of such a smoke run, and a
# smoke run checks the benchmark's own code (its launch, variants, pairing and figures). Each layout's compiled
# step is proven against one process by the equivalence tests (tests/test_fsdp.py, test_pipeline.py,
# test_context_parallel.py, test_expert_parallel.py, test_tensor_parallel.py).


def smoke_model(layers: int = 1, seq: int = 32) -> list[str]:
    """Overrides cutting a shipped model config to a smoke run's size: ``layers`` decoder layers (DeepSeek-V3 needs
    2: its first is dense, the MoE ones follow) and ``seq``-token sequences; the benchmark's layout stays. Put them
    after blend_settings(), which sets the demo's sequence length."""
    data = "train_dataset.dataloader.config"
    return [f"model.num_hidden_layers={layers}", f"{data}.seq_length={seq}", f"model.seq_length={seq}"]


def builtin_shard(work, corpus_bytes: int, settings=None):
    """The built-in source code corpus (``corpus_bytes`` of it) tokenized as the demo chain does, with Kiln's
    default tokenizer (or ``settings``) trained on it; its dataset prefix."""
    from assets.builtin_corpus import write_builtin_source
    from resources.tokenizer import TokenizerSettings
    from training.data.corpus import iter_texts
    from training.data.preprocess import tokenize_to_indexed

    files = write_builtin_source("python_stdlib_code", work / "raw", corpus_bytes)
    settings = settings or TokenizerSettings(sample_lines=50_000)
    settings.train((t for p in files for t in iter_texts(p)), work / "tokenizer")
    tokenize_to_indexed(files, work / "tokenizer.model", work / "shard", append_eod=True)
    return work / "shard_text_document"
