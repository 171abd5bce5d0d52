import warnings

# Kiln's partitioned data assets backfill in one run (BackfillPolicy.single_run: a chunked source's partitions share
# one process and one dedup pass); Dagster marks the parameter beta and warns at each decoration, which every user
# command importing the definitions would print. The choice is ours to revisit, not the user's to act on. (Matched by
# message: this package is also imported without Dagster, by pipelines.audit's cross-check.)
warnings.filterwarnings("ignore", message="Parameter `backfill_policy` of function `asset` is currently in beta")
