"""The upload thread and the step loop share an upload's duration: the loop takes it for
`checkpoint/upload_s` (once) while rank 0's after-upload hook prints it. The hook gets its own copy,
so a loop that takes the value first cannot leave the hook with None (CI failure of 2026-11-26:
`unsupported format string passed to NoneType.__format__` in the 'Saved checkpoint' line)."""

from __future__ import annotations

import threading

import pyarrow.fs as pafs
import pytest

from raytrain_fast.checkpoint.upload import Uploader

pytestmark = pytest.mark.unit


def test_the_after_upload_hook_gets_the_duration_even_when_the_loop_took_it_first(tmp_path):
    import ray.train

    source = tmp_path / "local"
    source.mkdir()
    (source / "weights.bin").write_bytes(b"x" * 1024)
    seen: list[object] = []
    taken: list[object] = []

    def after_upload(local_dir: str, dir_name: str, upload_s: float) -> None:
        taken.append(uploader.take_upload_s())  # the step loop's read, landing before the print
        seen.append(upload_s)

    uploader = Uploader(
        filesystem=pafs.LocalFileSystem(), run_path=str(tmp_path / "run"), attempts=1, after_upload=after_upload,
    )
    (tmp_path / "run" / "checkpoint_000002").mkdir(parents=True)  # a local filesystem wants the folder
    uploader.begin()
    stored = uploader.upload(ray.train.Checkpoint.from_directory(str(source)), "checkpoint_000002")

    assert (tmp_path / "run" / "checkpoint_000002" / "weights.bin").read_bytes() == b"x" * 1024
    assert stored.path.endswith("checkpoint_000002")
    assert len(seen) == 1 and isinstance(seen[0], float) and seen[0] >= 0
    assert taken == seen  # the loop took exactly this upload's duration
    assert uploader.take_upload_s() is None  # ... once
    assert uploader._idle.is_set()


def test_concurrent_takes_see_each_duration_at_most_once(tmp_path):
    """Many uploads while another thread keeps taking: every duration the hook saw is reported by
    the takes at most once, and none is invented."""
    import ray.train

    source = tmp_path / "local"
    source.mkdir()
    (source / "f").write_bytes(b"y")
    hook_saw: list[float] = []
    uploader = Uploader(
        filesystem=pafs.LocalFileSystem(), run_path=str(tmp_path / "run"), attempts=1,
        after_upload=lambda _dir, _name, seconds: hook_saw.append(seconds),
    )
    took: list[float] = []
    done = threading.Event()

    def loop() -> None:
        while not done.is_set():
            value = uploader.take_upload_s()
            if value is not None:
                took.append(value)

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        for index in range(30):
            (tmp_path / "run" / f"checkpoint_{index:06d}").mkdir(parents=True)
            uploader.begin()
            uploader.upload(ray.train.Checkpoint.from_directory(str(source)), f"checkpoint_{index:06d}")
    finally:
        done.set()
        thread.join()
    last = uploader.take_upload_s()
    took += [] if last is None else [last]
    assert len(hook_saw) == 30
    assert len(took) == len(set(took)) and set(took) <= set(hook_saw)


def _tree(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_local_storage_on_the_same_filesystem_links_the_files_instead_of_copying_them(tmp_path):
    import ray.train

    source = tmp_path / "local"
    (source / "deepspeed" / "step").mkdir(parents=True)
    (source / "deepspeed" / "step" / "optim.pt").write_bytes(b"o" * 4096)
    (source / "manifest.rank0.json").write_text("{}")
    uploader = Uploader(filesystem=pafs.LocalFileSystem(), run_path=str(tmp_path / "run"), attempts=1)
    uploader.begin()
    uploader.upload(ray.train.Checkpoint.from_directory(str(source)), "checkpoint_000004")

    stored = tmp_path / "run" / "checkpoint_000004"
    assert _tree(stored) == _tree(source)
    for name in ("deepspeed/step/optim.pt", "manifest.rank0.json"):
        assert (stored / name).stat().st_ino == (source / name).stat().st_ino  # one file on disk, two names
    import shutil

    shutil.rmtree(source)  # what Ray does with the local directory after the upload
    assert (stored / "deepspeed" / "step" / "optim.pt").read_bytes() == b"o" * 4096


def test_local_storage_on_another_filesystem_is_copied(tmp_path):
    import os
    import shutil
    import tempfile

    import ray.train

    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the test's temp directory")
    source = tempfile.mkdtemp(dir="/dev/shm")
    try:
        with open(os.path.join(source, "weights.bin"), "wb") as out:
            out.write(b"w" * 2048)
        uploader = Uploader(filesystem=pafs.LocalFileSystem(), run_path=str(tmp_path / "run"), attempts=1)
        uploader.begin()
        uploader.upload(ray.train.Checkpoint.from_directory(source), "checkpoint_000006")
        stored = tmp_path / "run" / "checkpoint_000006" / "weights.bin"
        assert stored.read_bytes() == b"w" * 2048
        assert stored.stat().st_ino != os.stat(os.path.join(source, "weights.bin")).st_ino
    finally:
        shutil.rmtree(source, ignore_errors=True)
