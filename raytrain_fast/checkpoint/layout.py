"""The names of the files in a checkpoint directory, in one leaf that saving, listing, exporting and
the report all read (no torch here, so listing runs never imports it)."""

DEEPSPEED_TAG = "deepspeed"
"""The subdirectory DeepSpeed's `save_checkpoint(tag=...)` writes every rank's shards into."""
CONFIG_FILE = "config.yaml"
"""The run's whole config at save time (credentials redacted): export reads its `model` section."""
STATE_FILE = "train_state.json"
"""The loop's TrainState (step, data position, metrics at save time)."""
