import os
import sys
from pathlib import Path

import numpy as np
import pytest

PROJECT_ROOT = Path(__file__).resolve().parent.parent
MICRO_CONFIG = "tests/configs/qwen3_micro.yaml"

# msrun starts workers with the `python` on PATH: make it this interpreter's
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
# synchronous dispatch, as training.run sets it before MindSpore loads (fast_step.host_blocking_dispatch), for the
# tests' own processes, the msrun workers and every subprocess: MindSpore's dispatch thread busy-waits on a core.
# Measured: test_trainer 175 s threaded, 62 s synchronous; test_pipeline's 4 workers on 2 cores 1604 s vs 82 s
os.environ.setdefault("MS_DEV_HOST_BLOCKING_RUN", "1")


def write_micro_sources(path: Path) -> Path:
    """Both built-in sources, small enough for a test-sized tokenizer and model."""
    path.write_text(
        "sources:\n"
        "  stdlib_code: {builtin: python_stdlib_code, max_bytes: 150000, weight: 0.6}\n"
        "  stdlib_docs: {builtin: python_stdlib_docstrings, max_bytes: 80000, weight: 0.4}\n")
    return path


def run_under_msrun(args: list, log_dir: Path, workers: int, *, timeout: float = 900) -> None:
    """Run ``args`` (a script and its arguments, or ``-m module ...``) under msrun on ``workers`` local CPU workers
    from the project root (as the benchmarks do); a failed launch fails the test with the tail of every worker's
    log (LaunchFailed), one over ``timeout`` seconds with TimeoutError."""
    from training.launch import run_on_local_workers

    run_on_local_workers(args, log_dir, workers, timeout=timeout)


def shard_data(shard) -> list[str]:
    """The overrides that point a test config at ``shard``: its documents end in EOD 2 (as write_random_documents
    writes them), pad 3."""
    return [f"train_dataset.dataloader.config.data_path=[1.0, '{shard}']", "train_dataset.dataloader.config.eod=2",
            "train_dataset.dataloader.config.pad=3"]


def train_alone(config, run_dir: Path) -> tuple[list[dict], dict]:
    """One process trains ``config`` into ``run_dir``: its step records and final weights, the reference a parallel
    layout's run must equal."""
    from training.parallel.mesh import World
    from training.reporting import Reporter, read_records
    from training.step import configure_runtime
    from training.trainer import Trainer

    configure_runtime(config)
    trainer = Trainer(config, World(0, 1), run_dir, Reporter(run_dir / "metrics.jsonl", enabled=True))
    trainer.train()
    return read_records(run_dir / "metrics.jsonl"), {p.name: p.asnumpy() for p in trainer.model.get_parameters()}


def validate_as_one_process(config, checkpoint: Path) -> float:
    """The validation loss one process computes (``config``'s validation, micro-batches of one sample as the msrun
    cases read them) of the weights in ``checkpoint``: what a parallel run's validation at that step must equal."""
    from mindspore import Tensor

    from training.checkpoint import load_checkpoint
    from training.evaluation import Validation
    from training.model import build_model
    from training.parallel.comm import Collectives
    from training.parallel.mesh import World
    from training.train_state import micro_batch_indices

    model = build_model(config.model)
    weights = load_checkpoint(checkpoint).model
    for param in model.get_parameters():
        param.set_data(Tensor(weights[param.name]))
    validation = Validation(config, model, Collectives(World(0, 1)), accumulation=config.training.global_batch_size,
                            use_positions=False, vocab_size=model.config.vocab_size,
                            sample_indices=lambda first, micro: micro_batch_indices(first, micro, 0, 1, 1))
    return validation.evaluate(config.training.steps)["val_loss"]


# Final weights after a few AdamW steps (lr up to 3e-3, eps 1e-5) of two runs whose sums add in another order: where a
# gradient is near zero, Adam turns its rounding noise δg into up to lr/eps·δg = 300·δg of weight. So all within
# 1e-5, and all but 1 in 1,000 entries within the run's own tolerance
NEAR_ZERO_GRADIENT_ATOL = 1e-5


def assert_adam_weights_close(actual: np.ndarray, expected: np.ndarray, atol: float, name: str) -> None:
    np.testing.assert_allclose(actual, expected, rtol=0, atol=NEAR_ZERO_GRADIENT_ATOL, err_msg=name)
    assert np.mean(np.abs(actual - expected) > atol) <= 1e-3, f"{name}: more than 1 in 1,000 entries past {atol}"


def assert_resumes_as_one_process(config, run_dir: Path, step: int, single: list[dict], expected: dict,
                                  loss_rtol: float, weight_atol: float) -> None:
    """One process resumes ``config`` (its checkpoint.load_path saved at ``step`` by a parallel run) and trains on
    as the uninterrupted single-process run did: the next step's loss (``single``: that run's records) and the
    final weights (``expected``)."""
    from training.parallel.mesh import World
    from training.reporting import Reporter, read_records
    from training.trainer import Trainer

    resumed = Trainer(config, World(0, 1), run_dir, Reporter(run_dir / "metrics.jsonl", enabled=True))
    assert resumed.step == step
    resumed.train()
    assert read_records(run_dir / "metrics.jsonl")[0]["loss"] == pytest.approx(single[step]["loss"], rel=loss_rtol)
    for param in resumed.model.get_parameters():
        np.testing.assert_allclose(param.asnumpy(), expected[param.name], rtol=0, atol=weight_atol, err_msg=param.name)


# The unit tier (`make test-fast`: not msrun, ui, browser or slow) must run in under 2 minutes on an idle 2-core
# machine. The rule: a test is slow when it needs more than 2 CPU-seconds (its process's and its subprocesses'
# user + system time), as these did when measured (2026-12-06, on the code at 740a682 and, for test_trainer and
# test_validation, at 2e5ef9d: 926 unit-tier tests, ~306 CPU-s, ~236 of them in these; the files added since,
# test_recompute, test_train_state, test_cleaning_ray, test_downstream, test_ablation, test_verified_load,
# test_parallel_plans, test_compare, test_cleaning, test_bad_inputs, test_error_boundary, test_tasks and the rest of
# the new files, at 0d73b28; then those the unit tier had grown over the bound, at 44b6a75: it took 108 s, 1,131
# tests, of which these 21 took 106 of the 172 test-seconds). A test that starts a server (Ray, Postgres) counts
# the seconds it waits for it, as the server's CPU is not its own. A new test over the bound joins the list.
SLOW_TESTS = frozenset({
    "interop/test_deepseek_v3_hf.py::test_export_matches_transformers[no_q_lora]",
    "interop/test_deepseek_v3_hf.py::test_export_matches_transformers[q_lora]",
    "interop/test_hf_tokenizer.py::test_autotokenizer_on_the_export_gives_kilns_ids",
    "interop/test_olmo_eval.py::test_kiln_scores_equal_olmo_eval_on_the_exported_model[arc_easy]",
    "interop/test_olmo_eval.py::test_kiln_scores_equal_olmo_eval_on_the_exported_model[hellaswag]",
    "interop/test_olmo_eval.py::test_kiln_scores_equal_olmo_eval_on_the_exported_model[piqa]",
    "interop/test_olmo_eval.py::test_kiln_scores_equal_olmo_eval_on_the_exported_model[winogrande]",
    "interop/test_qwen3_hf.py::test_export_matches_transformers[untied]",
    "test_ablation.py::test_a_variant_is_trained_per_seed_and_the_ranking_orders_by_task_bits_per_byte",
    "test_audit.py::test_the_cross_check_finds_a_link_however_many_materializations_came_after",
    "test_audit.py::test_training_imports_neither_dagster_nor_kilns_dagster_code",
    "test_audit_postgres.py::test_the_cross_check_reads_postgres_as_dagster_does",
    "test_automation.py::test_a_second_training_step_waits_for_the_npu_slot",
    "test_automation.py::test_assets_code_versions_follow_the_sources_config",
    "test_automation.py::test_changed_file_reingests_its_source_then_shards_and_manifest_follow",
    "test_bad_inputs.py::test_a_bad_input_is_refused_before_anything_is_built_naming_what_is_wrong[lists nested past any reader]",
    "test_checkpoint_eval.py::test_checkpoint_eval_is_requested_for_a_new_checkpoint_and_records_the_evaluation",
    "test_checkpoint_eval.py::test_kiln_eval_reports_each_source_on_the_test_split_and_audit_verifies_its_sidecar",
    "test_checks.py::test_changed_or_missing_shard_fails_the_manifest_check",
    "test_checks.py::test_truncated_bin_fails_the_blocking_check_and_stops_the_blend",
    "test_chunks.py::test_a_backfill_shards_every_chunk_two_steps_at_once_and_the_blend_gathers_them",
    "test_clean_corpus.py::test_a_chunk_cleaned_before_the_copy_it_holds_was_kept_elsewhere_is_reported_stale",
    "test_clean_corpus.py::test_a_step_removing_too_much_fails_the_check_and_a_new_parameter_is_a_new_data_version",
    "test_clean_corpus.py::test_duplicates_across_chunks_and_lineage_through_the_cleaned_files",
    "test_cleaning_ray.py::test_an_unreachable_ray_address_is_one_line",
    "test_cleaning_ray.py::test_clean_corpus_pointed_at_the_cluster_writes_what_it_writes_locally",
    "test_cleaning_ray.py::test_ray_cleaning_is_byte_identical_to_local",
    "test_code_versions.py::test_each_data_assets_parts_cover_the_project_code_it_runs",
    "test_config_errors.py::test_token_ids_past_the_vocabulary_are_one_line_without_a_traceback",
    "test_context_parallel.py::test_attention_with_the_context_parallel_core_on_one_rank_is_the_attention[tests/configs/qwen3_micro.yaml]",
    "test_data_assets.py::test_token_shards_records_every_shard_and_the_skipped_records",
    "test_deepseek_v3.py::test_eager_dispatch_sorts_on_the_host_and_equals_the_compiled_static_one",
    "test_deepseek_v3.py::test_the_compiled_step_equals_the_eager_one_and_resumes_bit_identically",
    "test_downstream.py::test_checkpoint_eval_plots_each_task_and_tabulates_the_scores",
    "test_downstream.py::test_packed_compiled_loglikelihoods_equal_each_request_scored_alone",
    "test_error_boundary.py::test_output_piped_into_head_ends_without_a_traceback",
    "test_fast_ops.py::test_causal_attention_in_query_blocks_is_the_full_masked_softmax",
    "test_faults.py::test_a_full_disk_and_a_shard_corrupted_after_its_check_keep_the_last_checkpoint_and_resume_to_the_same_losses",
    "test_gpt_dataset.py::test_mock_blend",
    "test_mindformers_yaml.py::test_a_run_with_dropout_resumed_from_a_checkpoint_repeats_the_uninterrupted_losses",
    "test_model.py::test_float16_compute_trains_on_cpu_close_to_float32",
    "test_model.py::test_init_is_deterministic_across_processes",
    "test_model_validation.py::test_the_training_run_asset_refuses_a_model_smaller_than_the_tokenizer_before_msrun",
    "test_monitor.py::test_an_unhealthy_step_marks_the_next_checkpoint",
    "test_monitor.py::test_every_train_state_option_lands_in_the_step_record",
    "test_monitor.py::test_profiler_runs_over_its_window_on_rank_0",
    "test_optim.py::test_tiny_model_memorizes_a_batch",
    "test_paired_step.py::test_a_side_that_cannot_build_is_named_and_a_directory_not_a_checkout_refused",
    "test_paired_step.py::test_one_checkout_on_both_sides_trains_the_same_steps_and_reports_each_side",
    "test_parallel_plans.py::test_the_plain_models_gradients_match_finite_differences",
    "test_recompute.py::test_compiled_recompute_trains_bit_identically_and_resumes",  # 52 (6 compiled trainers)
    "test_recompute.py::test_deepseek_v3_recomputing_its_moe_and_mtp_layers_trains_bit_identically",
    "test_recompute.py::test_eager_recompute_trains_bit_identically_with_dropout_and_resumes[full]",
    "test_recompute.py::test_eager_recompute_trains_bit_identically_with_dropout_and_resumes[layer1]",
    "test_recompute.py::test_eager_recompute_trains_bit_identically_with_dropout_and_resumes[mlp0]",
    "test_recompute.py::test_eager_recompute_trains_bit_identically_with_dropout_and_resumes[select]",
    "test_relocation.py::test_a_copied_tree_trains_into_itself_on_its_own_data_and_audits_against_itself",  # 3.6
    "test_resume.py::test_changed_global_batch_size_keeps_consumed_samples",
    "test_resume.py::test_weight_only_init_starts_at_step_zero_with_a_fresh_optimizer",
    "test_tasks.py::test_the_fast_set_is_known_and_each_document_ranks_its_choices_as_the_file_lists_them",
    "test_train_state.py::test_a_resume_says_when_the_lr_schedule_gives_another_rate_than_the_saved_run_was_at",
    "test_train_state.py::test_a_save_before_training_is_a_step_zero_checkpoint_that_trains_as_the_seed_does",
    "test_train_state.py::test_every_part_resumes_with_the_state_the_save_wrote",
    "test_trainer.py::test_a_mindformers_single_card_bfloat16_checkpoint_resumes_exactly_and_loads_weights_only",
    "test_trainer.py::test_a_resumed_run_saves_on_the_same_global_steps_as_an_uninterrupted_one",
    "test_trainer.py::test_a_start_behind_the_save_paths_checkpoints_is_refused_before_anything_is_written[older_checkpoint]",
    "test_trainer.py::test_a_start_behind_the_save_paths_checkpoints_is_refused_before_anything_is_written[weights_only]",
    "test_trainer.py::test_document_boundaries_change_what_the_model_sees",
    "test_trainer.py::test_float16_params_resume_exactly_with_their_fp32_masters",
    "test_trainer.py::test_gradients_read_on_the_host_keep_the_update_out_of_the_graph_with_the_eager_losses",
    "test_trainer.py::test_resume_reproduces_the_uninterrupted_losses",
    "test_trainer.py::test_same_seed_gives_bitwise_identical_losses",
    "test_trainer.py::test_the_compiled_whole_step_equals_the_eager_step_and_resumes_bit_identically",
    "test_trainer.py::test_threaded_dispatch_trains_to_the_same_losses_as_synchronous_dispatch",
    "test_trainer.py::test_too_many_nan_steps_in_a_row_stop_training",
    "test_trainer.py::test_with_accumulation_the_compiled_whole_step_equals_the_eager_one_through_nan_skips_and_the_stop",
    "test_validation.py::test_two_data_parallel_ranks_together_validate_what_one_process_does",
    "test_validation.py::test_validation_leaves_training_unchanged_and_a_resumed_run_validates_bit_identically",
    "test_validation.py::test_validation_loss_equals_a_separate_forward_and_is_reported_megatron_style",
})
# pytest-xdist's loadgroup hands the groups out by test count (its --loadscope-reorder default), ties in collection
# order. Longest first (--no-loadscope-reorder, groups sorted by their walls) was measured worse on 2 cores: the
# long groups are msrun launches, and run side by side they spin against each other (a fresh-clone `make test`,
# quiet: 1,677 s and 2,787 CPU-s, against 1,508 s and 2,302 CPU-s in xdist's order). Only the groups of one test,
# handed out last, are ordered: their longest first, so that the last ones are short. A worker handed a long one at
# the end ran it alone while the others had finished (test_browser_ui's 170-200 s, in three fresh-clone runs).
LONGEST_ONE_TEST_GROUPS = ("test_browser_ui.py", "benchmark-lineage_scale", "test_shipped_configs.py",
                           "benchmark-cleaning", "benchmark-throughput")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: more than 2 CPU-seconds (SLOW_TESTS in tests/conftest.py); not in "
                                       "make test-fast")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the groups into the test ids
def pytest_collection_modifyitems(items):
    """Each file is an xdist group (`make test` runs ``--dist loadgroup``), so it runs whole on one worker: the msrun
    files share one launch per file through module fixtures. A test that names its own group spreads (the benchmark
    smoke tests). LONGEST_ONE_TEST_GROUPS come first in the collection, so first among the groups of one test."""
    for item in items:
        if item.nodeid.removeprefix("tests/") in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
        if not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(item.path.name))
    order = {group: i for i, group in enumerate(LONGEST_ONE_TEST_GROUPS)}
    # stable: the other tests keep their order
    items.sort(key=lambda item: order.get(item.get_closest_marker("xdist_group").args[0], len(order)))


@pytest.fixture
def micro_sources(tmp_path) -> Path:
    return write_micro_sources(tmp_path / "sources.yaml")


def write_random_documents(prefix: Path, *, seed: int = 0, low: int = 4, high: int = 512,
                           documents: int = 200) -> Path:
    """A Megatron dataset of random documents (ids in [low, high), 5-59 of them), each ending in EOD (id 2)."""
    from training.data.indexed import IndexedDatasetWriter

    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(documents):
            writer.add_document(np.append(rng.integers(low, high, size=rng.integers(5, 60)), 2).astype(np.uint16))
    return prefix


@pytest.fixture
def shard(tmp_path) -> Path:
    """Random documents over the micro config's 512-token vocabulary."""
    return write_random_documents(tmp_path / "data/shards/random")
