"""The diagnosis's findings, one module each: its thresholds (with why) and `find(run)`."""
