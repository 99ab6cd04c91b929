"""Launching a run on Ray (`raytrain_fast.launch.trainer`): resources, storage, TorchTrainer."""
