"""The hang watchdog: heartbeats (heartbeat.py) to the run's coordinator actor, the decisions
(hang.py), and what it does about a hang (stacks.py). See docs/health-hangs.md."""
