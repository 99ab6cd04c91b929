"""The per-worker training loop (`raytrain_fast.loop.train_loop`)."""
