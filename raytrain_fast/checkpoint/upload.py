"""A rank's checkpoint uploads: retried, timed (`checkpoint/upload_s`), one in flight at a time, run
in Ray's upload thread (async) or inline (sync) through `ray.train.report`'s `checkpoint_upload_fn`."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

from raytrain_fast.errors import CheckpointError


class Uploader:
    """Copies a rank's local checkpoint directory into the run's storage."""

    def __init__(
        self, *, filesystem: Any, run_path: str, attempts: int, before_upload: Callable[[], None] | None = None,
        after_upload: Callable[[str, str, float], None] | None = None, finish_files: Callable[[str], None] | None = None,
    ) -> None:
        """`after_upload(local_dir, dir_name, upload_s)`: run in the upload thread once the files are in
        (rank 0 says so and prunes). `before_upload()`: run in the upload thread first (a caller's hook).
        `finish_files(local_dir)`: run in the upload thread before the copy: completes the local
        directory (the background writes, then the manifest), off the training thread."""
        self.filesystem, self.run_path = filesystem, run_path
        self.attempts, self.before_upload, self.after_upload = attempts, before_upload, after_upload
        self.finish_files = finish_files
        self._idle = threading.Event()
        self._idle.set()
        self._lock = threading.Lock()  # the step loop takes the duration while the upload thread sets it
        self.last_upload_s: float | None = None

    def begin(self) -> None:
        """A save hands its directory over: the next save waits until this upload is done (`wait`)."""
        self._idle.clear()

    def abandon(self) -> None:
        """The save failed before any upload started."""
        self._idle.set()

    def wait(self) -> None:
        self._idle.wait()

    def upload(self, checkpoint: Any, dir_name: str) -> Any:
        """Ray's `checkpoint_upload_fn`: copy, retrying; then `after_upload`. Returns the stored checkpoint."""
        import ray.train

        destination = f"{self.run_path}/{dir_name}"
        start = time.perf_counter()
        try:
            if self.before_upload is not None:
                self.before_upload()
            if self.finish_files is not None:
                self.finish_files(checkpoint.path)
            self._copy(checkpoint, destination, dir_name)
            upload_s = time.perf_counter() - start
            with self._lock:
                self.last_upload_s = upload_s
            if self.after_upload is not None:  # its own copy: the step loop may take last_upload_s meanwhile
                self.after_upload(checkpoint.path, dir_name, upload_s)
        finally:
            self._idle.set()
        return ray.train.Checkpoint(destination, self.filesystem)

    def _copy(self, checkpoint: Any, destination: str, dir_name: str) -> None:
        import pyarrow.fs as pafs

        if link_local_tree(checkpoint.path, destination, source_filesystem=checkpoint.filesystem, destination_filesystem=self.filesystem):
            return
        for attempt in range(1, self.attempts + 1):
            try:
                pafs.copy_files(
                    checkpoint.path, destination,
                    source_filesystem=checkpoint.filesystem, destination_filesystem=self.filesystem,
                )
                return
            except OSError as error:
                if attempt == self.attempts:
                    raise CheckpointError(
                        f"uploading {dir_name} to {destination} failed {attempt} times, last error: {error}. "
                        "Training stops here; the previous complete checkpoint is what a rerun resumes from."
                    ) from None
                time.sleep(min(2.0**attempt, 10.0))

    def take_upload_s(self) -> float | None:
        """Duration of the last finished upload, once (None if none finished since the last call)."""
        with self._lock:
            value, self.last_upload_s = self.last_upload_s, None
        return value


def link_local_tree(source: str, destination: str, *, source_filesystem: Any, destination_filesystem: Any) -> bool:
    """Local storage on the same filesystem as the local checkpoint: hard-link every file instead of
    copying it. Nothing is written, so a checkpoint of any size is in storage at once and the disk
    holds it once (a 1B model's ZeRO-2 checkpoint is about 17 GB). Ray deletes the local directory
    after the upload, which leaves the links in storage. The files are complete (their manifest is
    written last) and nothing writes to them again. False where either side is not a local
    filesystem, they are different filesystems, or a link fails: the caller copies instead."""
    import pyarrow.fs as pafs

    if not (isinstance(source_filesystem, pafs.LocalFileSystem) and isinstance(destination_filesystem, pafs.LocalFileSystem)):
        return False
    target_root = os.path.abspath(destination)
    os.makedirs(target_root, exist_ok=True)
    if os.stat(source).st_dev != os.stat(target_root).st_dev:
        return False
    try:
        for folder, _, files in os.walk(source):
            target = os.path.join(target_root, os.path.relpath(folder, source))
            os.makedirs(target, exist_ok=True)
            for name in files:
                target_file = os.path.join(target, name)
                if os.path.lexists(target_file):  # a retried upload: replace what an earlier try left
                    os.unlink(target_file)
                os.link(os.path.join(folder, name), target_file)
    except OSError:  # a filesystem without hard links: copy the whole checkpoint instead
        shutil.rmtree(target_root, ignore_errors=True)
        return False
    return True
