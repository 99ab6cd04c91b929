"""Downstream evaluation: multiple-choice tasks (the standard ones shipped in data/, and JSONL files of
one's own) scored by log-likelihood, inside the step loop at the held-out evaluation's cadence
(in_loop.py) and on any checkpoint or Hugging Face directory (`raytrain-fast evaluate`, command.py).
docs/evaluation.md is the user's page."""
