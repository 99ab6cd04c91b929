"""Every row of the bad-input table in docs/errors.md: the command fails (or, for a credential in a
setting, succeeds) with the documented exit code, a message that names the problem and the fix,
within seconds (before Ray starts), and a planted secret appears in no output and no written file.

The cases run in-process through raytrain_fast.cli.main: no Ray, no subprocess, so the whole table
takes seconds. Only the S3 rows talk to the loopback S3 server (or to a closed port)."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from raytrain_fast.cli import main
from tests.s3_server import free_port
from tests.shared_ray import without_shared_ray

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parent.parent
SECRET = "planted-Secret-0123456789abcdef"
LIMIT_S = 10.0  # "in seconds": generous for a 2-core machine under load; these fail before Ray starts


@dataclass(frozen=True)
class Case:
    id: str
    """Also the row's first cell in docs/errors.md."""
    argv: list[str]
    code: int
    says: list[str]
    """Substrings of the output: the problem and the fix (regexes)."""
    setup: str = ""
    """Name of a function below that prepares files under tmp_path."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment; "S3" = the loopback server's credentials."""


def _s(*overrides: str) -> list[str]:
    return [part for override in overrides for part in ("--set", override)]


CASES = [
    # ---- config
    Case("unknown-key", ["pretrain", *_s("train.stepz=1")], 2, ["unknown key 'train.stepz'", "known keys here: .*steps"]),
    Case("wrong-type", ["pretrain", *_s("train.steps=abc")], 2, ["train.steps: expected an integer, got 'abc'"]),
    Case("wrong-choice", ["pretrain", *_s("engine.precision=fp16")], 2, ["engine.precision: must be one of 'auto', 'bf16', 'fp32', 'fp8'"]),
    Case("fp8-on-cpus", ["pretrain", *_s("engine.precision=fp8", "resources.use_gpu=false")], 2,
         ["engine.precision=fp8 needs a GPU with FP8 tensor cores", "use engine.precision=bf16"]),
    Case("malformed-set", ["pretrain", "--set", "train.steps"], 2, ["--set 'train.steps': expected section.field=value, e.g."]),
    Case("set-into-a-value", ["pretrain", *_s("train.steps.x=1")], 2, ["'steps' is not a section"]),
    Case("not-positive", ["pretrain", *_s("train.micro_batch=0")], 2, ["train.micro_batch must be > 0, got 0"]),
    Case("batch-arithmetic", ["pretrain", *_s("resources.num_workers=2")], 2,
         ["not a multiple of train.micro_batch x resources.num_workers", "train.micro_batch=8", "train.grad_accum=2",
          "train.global_batch=32"]),
    Case("bad-worker-range", ["pretrain", *_s("resources.num_workers=4-1")], 2,
         [r"resources.num_workers: the range 4-1 must have 1 <= MIN <= MAX", "--set resources.num_workers=1-2 --set train.micro_batch=8"]),
    Case("bad-worker-range", ["pretrain", *_s("resources.num_workers=2-x")], 2,
         [r"resources.num_workers: expected a number of workers or a range MIN-MAX .*got '2-x'", "--set resources.num_workers=2 --set train.micro_batch=8"]),
    Case("elastic-batch", ["pretrain", *_s("resources.num_workers=1-4")], 2,  # both problems in one message
         [r"\(2 problems\)", r"not a multiple of train.micro_batch x resources.num_workers \(16 x 4 = 64\)",
          r"cannot be kept on 3 worker\(s\) \(not a divisor\)", "--set resources.num_workers=1-2 --set train.micro_batch=8"]),
    Case("batch-with-grad-accum", ["pretrain", *_s("train.grad_accum=3")], 2,
         [r"!= micro_batch x grad_accum x num_workers", "train.grad_accum=1", "train.global_batch=48"]),
    Case("warmup-too-long", ["pretrain", *_s("train.steps=10")], 2, [r"optim.warmup_steps \(20\) exceeds train.steps \(10\)",
                                                                      "--set optim.warmup_steps=1"]),
    Case("wsd-decay-too-long", ["pretrain", *_s("optim.schedule=wsd", "train.steps=100", "optim.decay_steps=90")], 2,
         [r"optim.decay_steps \(90\) \+ optim.warmup_steps \(20\) exceed train.steps \(100\)", "--set optim.decay_steps=80"]),
    Case("missing-config-file", ["pretrain", "--config", "{tmp}/nope.yaml"], 2, ["--config file .*nope.yaml' does not exist", "preset: .*tiny"]),
    Case("unknown-preset", ["pretrain", "--config", "gpt-350"], 2, ["'gpt-350' is not a preset", "did you mean 'gpt-350m'"]),
    Case("config-not-yaml", ["pretrain", "--config", "{tmp}/bad.yaml"], 2, ["bad.yaml: not valid YAML", "line 1"], setup="bad_yaml"),
    Case("duplicate-key", ["pretrain", "--config", "{tmp}/dup.yaml"], 2, ["duplicate key 'steps' .line 3.", "keep one of them"],
         setup="dup_yaml"),
    Case("config-not-a-mapping", ["pretrain", "--config", "{tmp}/list.yaml"], 2, ["top level must be a mapping", "docs/configuration.md"],
         setup="list_yaml"),
    Case("bad-run-name", ["pretrain", "--name", "a/b"], 2, ["name 'a/b'", "use letters, digits"]),
    Case("seq-len-too-long", ["pretrain", *_s("data.seq_len=512")], 2, ["exceeds model.max_seq_len", "raise model.max_seq_len or lower"]),
    Case("heads-do-not-divide", ["pretrain", *_s("model.num_heads=3")], 2, ["must be divisible by model.num_heads", "model.num_heads=2"]),
    Case("masking-dropout-on-gpu", ["pretrain", *_s("data.document_masking=on", "model.dropout=0.1", "resources.use_gpu=true")], 2,
         ["data.document_masking on a GPU uses flex attention, which has no dropout, but model.dropout is 0.1",
          "set model.dropout=0 .* or data.document_masking=false"]),
    Case("eod-loss-without-masking", ["pretrain", *_s("data.mask_loss_after_eod=false")], 2,
         ["data.mask_loss_after_eod applies only with data.document_masking on", "set data.document_masking=true or leave it out"]),
    Case("data-source-missing", ["pretrain", *_s("data.source={tmp}/no-text")], 2, ["data.source .* does not exist", "or 'stdlib'"]),
    Case("tokenizer-missing", ["pretrain", *_s("data.tokenizer={tmp}/t.json")], 2, ["neither 'byte' nor an existing", "tokenizer.json"]),
    Case("bad-drill", ["pretrain", "--drill", "slow_dat=1"], 2, ["NAME one of"]),
    Case("unknown-task", ["pretrain", *_s("eval.tasks=arc_eazy", "storage.uri={tmp}/runs")], 2,
         ["eval.tasks: unknown task 'arc_eazy'", "did you mean 'arc_easy'", "standard tasks: arc_easy, arc_challenge", r"\.jsonl file"]),
    Case("malformed-task-item", ["pretrain", *_s("eval.tasks={tmp}/mine.jsonl", "storage.uri={tmp}/runs")], 2,
         ['mine.jsonl line 2: "gold" must be the index of the right choice, 0 to 1; got 2'], setup="bad_task"),
    # ---- storage
    Case("gs-scheme", ["pretrain", *_s("storage.uri=gs://bucket/runs")], 2, ["scheme 'gs://' is not supported", "s3://bucket/prefix",
                                                                              "storage.googleapis.com"]),
    Case("hdfs-scheme", ["pretrain", *_s("storage.uri=hdfs://nn:8020/runs")], 2, ["scheme 'hdfs://' is not supported", "file:///"]),
    Case("s3-one-slash", ["pretrain", *_s("storage.uri=s3:/bucket")], 2, ["'s3:/bucket' is not a valid URI .missing '//'", "s3://"]),
    Case("s3-no-bucket", ["pretrain", *_s("storage.uri=s3://")], 2, ["names no bucket", "s3://<bucket>/<prefix>"]),
    Case("init-from-typo", ["pretrain", *_s("checkpoint.init_from=s3:/b/run/checkpoint_00000100")], 2,
         ["checkpoint.init_from .* not a valid URI", "s3://"]),
    Case("storage-not-writable", ["pretrain", *_s("storage.uri={tmp}/file/runs")], 2, ["is not writable", "--set storage.uri=<dir>"],
         setup="blocking_file"),
    Case("s3-endpoint-unreachable", ["pretrain", *_s("storage.uri=s3://bkt/runs", f"storage.endpoint_url=http://admin:{SECRET}@127.0.0.1:{{port}}")],
         2, ["Cannot reach endpoint http://127.0.0.1:", "Check storage.endpoint_url"], env={"S3": "1"}),
    # A local storage.uri / data.cache_dir on a Ray cluster of 2 nodes (ray.cluster_utils.Cluster): refused
    # once Ray is joined, before any worker starts (see test_shared_storage_is_accepted_on_two_nodes).
    Case("local-storage-multi-node", ["pretrain", *_s("storage.uri={tmp}/runs")], 2,
         ["storage.uri '.*/runs' is a local directory, but the Ray cluster has 2 nodes", "s3://bucket/prefix",
          "--set storage.shared=true"], env={"RAY_CLUSTER": "1"}),
    Case("local-cache-multi-node", ["pretrain", "--create-bucket", *_s("storage.uri=s3://multi-node/runs", "storage.endpoint_url={s3}",
                                                                         "data.cache_dir={tmp}/cache")], 2,
         ["data.cache_dir '.*/cache' is a local directory, but the Ray cluster has 2 nodes", "--set storage.shared=true"],
         env={"S3": "1", "RAY_CLUSTER": "1"}),
    Case("s3-no-credentials", ["pretrain", *_s("storage.uri=s3://bkt/runs", "storage.endpoint_url={s3}")], 2,
         ["No S3 credentials found for bucket 'bkt'", "AWS_ACCESS_KEY_ID", "storage.profile"]),
    Case("s3-half-credentials", ["pretrain", *_s("storage.uri=s3://bkt/runs", "storage.endpoint_url={s3}")], 2,
         ["AWS_SECRET_ACCESS_KEY is set but AWS_ACCESS_KEY_ID is not", "set both"], env={"AWS_SECRET_ACCESS_KEY": SECRET}),
    Case("s3-missing-bucket", ["pretrain", *_s("storage.uri=s3://no-such-bucket-x/runs", "storage.endpoint_url={s3}")], 2,
         ["Bucket 'no-such-bucket-x' does not exist", "--create-bucket"], env={"S3": "1"}),
    Case("credentials-in-endpoint-url", ["show-config", *_s(f"storage.endpoint_url=http://admin:{SECRET}@127.0.0.1:9000")], 0,
         [r"endpoint_url: http://admin:\*\*\*@127.0.0.1:9000"]),
    Case("presigned-url-in-a-setting", ["show-config", *_s(f"data.source=https://h/x?X-Amz-Signature={SECRET}&a=1")], 2,
         [r"X-Amz-Signature=\*\*\*", "not supported"]),
    # ---- checkpoints
    Case("resume-must-without-checkpoint", ["pretrain", "--resume", "must", *_s("storage.uri={tmp}/runs")], 2,
         ["--resume must: run 'tiny' has no complete checkpoint", "raytrain-fast runs --storage", "--resume auto"]),
    Case("resume-never-with-checkpoint", ["pretrain", "--resume", "never", *_s("storage.uri={tmp}/runs")], 2,
         [r"--resume never: run 'tiny' already has 1 checkpoint\(s\)", "Pick another --name", "--resume auto"],
         setup="complete_checkpoint"),
    Case("resume-worker-count-no-fit", ["pretrain", *_s("storage.uri={tmp}/runs", "resources.num_workers=3")], 2,
         ["saved by 1 workers with a global batch of 16 sequences; 3 workers cannot keep it",
          "resources.num_workers set to one of 1, 2, 4, 8, 16", "checkpoint.init_from"], setup="complete_checkpoint"),
    Case("resume-other-precision", ["pretrain", *_s("storage.uri={tmp}/runs", "engine.precision=fp32")], 2,
         [r"engine.precision=fp32, but run 'tiny' was checkpointed in bf16 \(step 300\)", "Resume with engine.precision=bf16 \\(or auto\\)",
          "checkpoint.init_from"], setup="complete_checkpoint"),
    Case("runs-missing-storage", ["runs", "--storage", "{tmp}/does-not-exist"], 2, ["does-not-exist' does not exist", "Check the path"]),
    Case("runs-unsupported-scheme", ["runs", "--storage", "gs://bucket/runs"], 2, ["scheme 'gs://' is not supported"]),
    Case("runs-unreachable-endpoint", ["runs", "--storage", "s3://bkt/runs", "--endpoint-url", "http://127.0.0.1:{port}"], 2,
         ["Cannot read s3://bkt/runs", "Check storage.endpoint_url"], env={"S3": "1"}),
    Case("resume-with-other-data", ["pretrain", *_s("storage.uri={tmp}/runs")], 2,
         [r"run 'tiny' was checkpointed at step 300 with other data settings than this command's "
          r"\(data.source: '/elsewhere/corpus' -> 'stdlib'\)", "another --name", "checkpoint.init_from=.*checkpoint_00000300",
          "--set checkpoint.allow_changes=data"], setup="checkpoint_of_other_data"),
    Case("resume-step-missing", ["pretrain", *_s("storage.uri={tmp}/runs", "checkpoint.resume=200")], 2,
         [r"checkpoint.resume=200: run 'tiny' has no complete checkpoint at step 200 .*complete ones: 300\)",
          "checkpoint.resume=auto"], setup="complete_checkpoint"),
    Case("runs-incomplete-checkpoint", ["runs", "--storage", "{tmp}/runs"], 3,
         ["INCOMPLETE: it has no manifest", "incomplete or corrupt .exit code 3.", "resumes from its newest complete one"],
         setup="incomplete_checkpoint"),
    Case("export-no-complete-checkpoint", ["export", "--storage", "{tmp}/runs", "--name", "r1", "--out", "{tmp}/out"], 2,
         ["has no complete checkpoint .checkpoint_00000010: it has no manifest", "raytrain-fast runs --storage"],
         setup="incomplete_checkpoint"),
    Case("export-step-missing", ["export", "--storage", "{tmp}/runs", "--name", "r1", "--step", "99", "--out", "{tmp}/out"], 2,
         [r"no checkpoint at step 99 \(steps: \[10\]\)", "leave out --step"], setup="incomplete_checkpoint"),
    Case("export-would-overwrite", ["export", "--storage", "{tmp}/runs", "--name", "r1", "--out", "{tmp}/out"], 2,
         ["already holds config.yaml", "--overwrite"], setup="earlier_export"),
    Case("export-bad-dtype", ["export", "--storage", "x", "--name", "r", "--out", "o", "--dtype", "fp16"], 2,
         ["invalid choice: 'fp16'", "'bf16'"]),
    Case("report-missing-storage", ["report", "--storage", "{tmp}/nope", "--name", "tiny"], 2, ["nope' does not exist", "Check the path"]),
    # ---- data
    Case("prepare-missing-input", ["prepare-data", "--input", "{tmp}/no.txt", "--output", "{tmp}/data", "--seq-len", "8"], 2,
         ["no input files to prepare: check the --input paths", "does not exist"]),
    Case("prepare-seq-len-zero", ["prepare-data", "--input", "{tmp}/in.txt", "--output", "{tmp}/data", "--seq-len", "0"], 2,
         ["--seq-len must be >= 1", "--seq-len 128"], setup="text"),
    Case("prepare-output-typo", ["prepare-data", "--input", "{tmp}/in.txt", "--output", "s3:/bucket/data", "--seq-len", "8"], 2,
         ["--output 's3:/bucket/data' is not a valid URI"], setup="text"),
    Case("prepare-over-other-data", ["prepare-data", "--input", "{tmp}/other.txt", "--output", "{tmp}/data", "--seq-len", "8"], 2,
         ["different", "--overwrite"], setup="prepared"),
    Case("manifest-corrupted-by-store", ["prepare-data", "--input", "{tmp}/in.txt", "--output", "{tmp}/data", "--seq-len", "8"], 2,
         ["manifest.json is not valid JSON", "corrupted by the store .it starts with aws-chunked", "storage.request_checksums=when_required"],
         setup="framed_manifest"),
    Case("data-seq-len-differs", ["pretrain", *_s("data.source={tmp}/data")], 2,
         [".*/data was prepared with seq_len 8 but data.seq_len is 128", "set data.seq_len=8"], setup="prepared"),
    # ---- mixtures (data.sources)
    Case("mixture-weight-not-positive", ["pretrain", *_s("data.sources=[{source: stdlib, weight: 0.7}, {source: stdlib, name: b, weight: 0}]")], 2,
         [r"data.sources\[1\].weight must be a number > 0, got 0", "give every source a positive share"]),
    Case("mixture-weight-not-a-number", ["pretrain", *_s("data.sources=[{source: stdlib, weight: lots}]")], 2,
         [r"data.sources\[0\].weight: expected a number, got 'lots'"]),
    Case("mixture-source-missing", ["pretrain", *_s("data.sources=[{source: '{tmp}/data', weight: 0.7}, {source: '{tmp}/nope', weight: 0.3}]",
                                                    "data.seq_len=8")], 2,
         ["data.sources '.*/nope' does not exist", "or remove it from data.sources"], setup="prepared"),
    Case("mixture-source-empty", ["pretrain", *_s("data.sources=[{source: '{tmp}/data', weight: 0.7}, {source: '{tmp}/empty', weight: 0.3}]",
                                                  "data.seq_len=8")], 2,
         ["data.sources '.*/empty' is empty", "add text to it, or remove it from data.sources"], setup="mixture_empty_source"),
    Case("mixture-seq-len-differs", ["pretrain", *_s("data.sources=[{source: '{tmp}/data', weight: 0.7}, {source: '{tmp}/data16', weight: 0.3}]",
                                                     "data.seq_len=8")], 2,
         ["prepared with seq_len 16 but data.seq_len is 8", "prepare it again with --seq-len 8"], setup="mixture_seq_lens"),
    Case("mixture-tokenizers-differ", ["pretrain", *_s("data.sources=[{source: '{tmp}/data', weight: 0.7}, {source: '{tmp}/bpe', weight: 0.3}]",
                                                       "data.seq_len=8")], 2,
         ["was tokenized with .*tok.* but 'data' with byte", "prepare every source with the same --tokenizer"], setup="mixture_tokenizers"),
    Case("prepare-parquet-without-column", ["prepare-data", "--input", "{tmp}/posts.parquet", "--output", "{tmp}/data", "--seq-len", "8"], 2,
         [r"posts.parquet: the Parquet file has no column 'text'; its columns: 'id' \(int64\), 'body' \(string\)",
          "Set --text-field to the column that holds the text"], setup="parquet_posts"),
    Case("prepare-jsonl-every-record-bad", ["prepare-data", "--input", "{tmp}/posts.jsonl", "--output", "{tmp}/data", "--seq-len", "8"], 2,
         [r"posts.jsonl: no usable JSONL records: 3 no string 'text' field \(first at line 1\)",
          "The fields its records have: 'id', 'body'; set --text-field"], setup="jsonl_posts"),
    Case("prepare-tokenizer-dir-without-file", ["prepare-data", "--input", "{tmp}/in.txt", "--output", "{tmp}/data", "--seq-len", "8",
                                                "--tokenizer", "{tmp}/model"], 2,
         ["is a directory without a tokenizer.json", "train-tokenizer"], setup="model_dir_without_tokenizer"),
    Case("train-tokenizer-missing-input", ["train-tokenizer", "--input", "{tmp}/no.txt", "--output", "{tmp}/tok"], 2,
         ["no input files to train on: check the --input paths", "does not exist"]),
    Case("train-tokenizer-vocab-too-small", ["train-tokenizer", "--input", "{tmp}/in.txt", "--output", "{tmp}/tok", "--vocab-size", "100"], 2,
         ["--vocab-size must be at least 258", "--vocab-size 32000"], setup="text"),
    Case("train-tokenizer-output-exists", ["train-tokenizer", "--input", "{tmp}/in.txt", "--output", "{tmp}/tok"], 2,
         [r"already holds a tokenizer \(tokenizer.json", "--overwrite"], setup="trained_tokenizer"),
    Case("train-tokenizer-bad-eod", ["train-tokenizer", "--input", "{tmp}/in.txt", "--output", "{tmp}/tok", "--eod-token", "<end>"], 2,
         ["--eod-token must be one of <|endoftext|>, </s>", "got '<end>'"], setup="text"),
    # ---- command line
    Case("unknown-command", ["pretrian"], 2, ["invalid choice: 'pretrian'"]),
    Case("bench-overhead-window", ["bench", "overhead", "--steps", "3"], 2,
         [r"--steps \(3\) and --warmup-steps \(50\) must be multiples of --log-every \(50\)", "e.g. --steps 50 --warmup-steps 50"]),
    Case("bench-unknown-variant", ["bench", "overhead", "--variants", "bare,nope"], 2, ["--variants: unknown 'nope'; valid: bare, "]),
    Case("bench-health-rounds", ["bench", "health", "--rounds", "1"], 2, [r"bench health needs .*--rounds >= 2", "got --steps"]),
    Case("missing-required-flag", ["runs"], 2, ["the following arguments are required: --storage"]),
    Case("bad-sweep-micro-batch", ["sweep", "--micro-batch", "a,b"], 2, ["--micro-batch 'a,b': expected comma-separated integers"]),
]


# ---------------------------------------------------------------- setups


def bad_yaml(tmp: Path) -> None:
    (tmp / "bad.yaml").write_text("train: {steps: 1\n")


def bad_task(tmp: Path) -> None:
    (tmp / "mine.jsonl").write_text('{"context": "Q", "choices": [" a", " b"], "gold": 0}\n{"context": "Q", "choices": [" a", " b"], "gold": 2}\n')


def dup_yaml(tmp: Path) -> None:
    (tmp / "dup.yaml").write_text("train:\n  steps: 1\n  steps: 2\n")


def list_yaml(tmp: Path) -> None:
    (tmp / "list.yaml").write_text("[1, 2]\n")


def blocking_file(tmp: Path) -> None:
    (tmp / "file").write_text("a file where a directory should be")


def incomplete_checkpoint(tmp: Path) -> None:
    checkpoint = tmp / "runs" / "r1" / "checkpoint_00000010"
    checkpoint.mkdir(parents=True)
    (checkpoint / "train_state.json").write_text('{"step": 10}')


def complete_checkpoint(tmp: Path) -> None:
    """Run 'tiny' with a complete (manifested) checkpoint at step 300, saved by 1 worker."""
    from raytrain_fast.checkpoint.rank_manifest import write_rank_manifest

    checkpoint = tmp / "runs" / "tiny" / "checkpoint_00000300"
    checkpoint.mkdir(parents=True)
    (checkpoint / "train_state.json").write_text('{"step": 300, "world_size": 1, "metrics": {"train/loss": 2.5}}')
    write_rank_manifest(str(checkpoint), rank=0, world_size=1, step=300)


def checkpoint_of_other_data(tmp: Path) -> None:
    """complete_checkpoint, with the run config it was saved with: another data.source."""
    import yaml

    from raytrain_fast.config import load_config

    complete_checkpoint(tmp)
    saved = load_config("tiny").to_dict()
    saved["data"]["source"] = "/elsewhere/corpus"
    (tmp / "runs" / "tiny" / "checkpoint_00000300" / "config.yaml").write_text(yaml.safe_dump(saved))


def earlier_export(tmp: Path) -> None:
    incomplete_checkpoint(tmp)
    (tmp / "out").mkdir()
    (tmp / "out" / "config.yaml").write_text("model: {}\n")


def text(tmp: Path) -> None:
    (tmp / "in.txt").write_text("Some text for the tokenizer. " * 20)


def parquet_posts(tmp: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": [1, 2, 3], "body": ["A post. " * 20] * 3}), tmp / "posts.parquet")


def jsonl_posts(tmp: Path) -> None:
    (tmp / "posts.jsonl").write_text("".join(f'{{"id": {i}, "body": "A post."}}\n' for i in range(3)))


def prepared(tmp: Path) -> None:
    from raytrain_fast.data import prepare_data

    text(tmp)
    (tmp / "other.txt").write_text("Other text. " * 40)
    prepare_data(inputs=[str(tmp / "in.txt")], output=str(tmp / "data"), seq_len=8, parallel=False, verbose=False)


def mixture_empty_source(tmp: Path) -> None:
    prepared(tmp)
    (tmp / "empty").mkdir()
    (tmp / "empty" / "a.txt").write_text("")


def mixture_seq_lens(tmp: Path) -> None:
    from raytrain_fast.data import prepare_data

    prepared(tmp)
    prepare_data(inputs=[str(tmp / "other.txt")], output=str(tmp / "data16"), seq_len=16, parallel=False, verbose=False)


def mixture_tokenizers(tmp: Path) -> None:
    from raytrain_fast.data import prepare_data
    from raytrain_fast.data.train_tokenizer import train_tokenizer

    prepared(tmp)
    (tmp / "words.txt").write_text(" ".join(f"word{i % 50} text{i % 7}" for i in range(3000)))
    train_tokenizer(inputs=[str(tmp / "words.txt")], output=str(tmp / "tok"), vocab_size=300, verbose=False)
    prepare_data(inputs=[str(tmp / "words.txt")], output=str(tmp / "bpe"), seq_len=8, tokenizer=str(tmp / "tok"), parallel=False, verbose=False)


def model_dir_without_tokenizer(tmp: Path) -> None:
    text(tmp)
    (tmp / "model").mkdir()
    (tmp / "model" / "config.json").write_text("{}")


def trained_tokenizer(tmp: Path) -> None:
    text(tmp)
    (tmp / "tok").mkdir()
    (tmp / "tok" / "tokenizer.json").write_text("{}")


def framed_manifest(tmp: Path) -> None:
    text(tmp)
    (tmp / "data").mkdir()
    (tmp / "data" / "manifest.json").write_bytes(b'3e8\r\n{"format_version": 1}\r\n0\r\nx-amz-checksum-crc64nvme:AAAA\r\n\r\n')


# ---------------------------------------------------------------- the test


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """cwd in tmp_path (so defaults such as ./runs land there), no AWS files, metadata or keys."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "RAY_ADDRESS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("RAYTRAIN_FAST_TEST_TOKEN", SECRET)  # a secret-named variable: never printed
    return work


def _fill(word: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        word = word.replace("{" + key + "}", value)
    return word


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, isolated: Path, request, monkeypatch, capsys):
    values = {"tmp": str(isolated), "port": str(free_port())}
    if "{s3}" in " ".join(case.argv) or case.env.get("S3"):
        server = request.getfixturevalue("s3_server")
        values["s3"] = server.endpoint_url
        if case.env.get("S3"):
            monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing-access-key")
            monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    if case.env.get("RAY_CLUSTER"):
        monkeypatch.setenv("RAY_ADDRESS", request.getfixturevalue("two_node_cluster"))
    for key, value in case.env.items():
        if key not in ("S3", "RAY_CLUSTER"):
            monkeypatch.setenv(key, value)
    if case.setup:
        globals()[case.setup](isolated)
    argv = [_fill(word, values) for word in case.argv]

    start = time.monotonic()
    try:
        code = main(argv)
    except SystemExit as exit:  # argparse's own errors
        code = exit.code
    seconds = time.monotonic() - start
    if case.env.get("RAY_CLUSTER"):
        import ray

        ray.shutdown()  # leave the cluster: the next test joins or starts its own Ray
    out, err = capsys.readouterr()

    assert code == case.code, f"exit {code}, expected {case.code}\nstdout: {out}\nstderr: {err}"
    assert seconds < LIMIT_S, f"took {seconds:.1f}s"
    text_out = out + err
    for pattern in case.says:
        assert re.search(pattern, text_out), f"{pattern!r} not in:\n{text_out}"
    if code != 0:
        # Refused before anything was measured or started: no precision, no run line.
        assert not re.search(r"^(Precision:|Run '|Data:)", out, flags=re.M), out
        # argparse names the subcommand: "raytrain-fast runs: error: ..."
        assert re.search(r"^raytrain-fast( [\w-]+)?: error: ", err, flags=re.M) and "Traceback" not in text_out
    assert SECRET not in text_out
    for path in isolated.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), f"{path} holds the planted secret"


@pytest.fixture(scope="module")
def two_node_cluster():
    """The address of a real 2-node Ray cluster (ray.cluster_utils.Cluster, 1 CPU each). A Ray
    instance this process had (the session's) is set aside meanwhile (tests/shared_ray.py)."""
    from ray.cluster_utils import Cluster

    with without_shared_ray():
        cluster = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 1, "include_dashboard": False})
        try:
            cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            yield cluster.address
        finally:
            cluster.shutdown()


def test_shared_storage_is_accepted_on_two_nodes(two_node_cluster, isolated, monkeypatch):
    """storage.shared=true (an NFS mount, say) lifts both refusals of the table above."""
    import ray

    from raytrain_fast.config import load_config
    from raytrain_fast.launch.checks import check_run
    from raytrain_fast.launch.plan import on_the_cluster

    monkeypatch.setenv("RAY_ADDRESS", two_node_cluster)
    config = load_config("tiny", [f"storage.uri={isolated}/runs", f"data.cache_dir={isolated}/cache", "storage.shared=true",
                                   "engine.precision=fp32"])
    try:
        resolved, _ = on_the_cluster(check_run(config).config)
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    finally:
        ray.shutdown()
    assert resolved.storage.shared and resolved.resources.cpus_per_worker >= 1


def test_the_table_in_the_docs_lists_every_case():
    table = (ROOT / "docs" / "errors.md").read_text()
    rows = {m.group(1) for m in re.finditer(r"^\| `([\w-]+)` \|", table, flags=re.M)}
    ids = {c.id for c in CASES}
    assert ids <= rows, f"docs/errors.md has no row for {sorted(ids - rows)}"
    assert rows <= ids, f"docs/errors.md rows without a case in tests/test_bad_input.py: {sorted(rows - ids)}"
    assert len(ids) >= 30


def test_debug_shows_the_traceback(capsys):
    assert main(["--debug", "pretrain", "--set", "train.micro_batch=0"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().endswith("train.micro_batch must be > 0, got 0")


def test_a_finished_run_is_nothing_to_do_before_ray_starts(isolated, monkeypatch, capsys):
    import raytrain_fast.launch.plan as plan

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started for a run that had nothing to do")

    monkeypatch.setattr(plan, "ensure_ray", no_ray)
    complete_checkpoint(isolated)
    assert main(["pretrain", "--set", f"storage.uri={isolated}/runs"]) == 0
    out = capsys.readouterr().out
    assert "already reached train.steps=300 (checkpoint at step 300); nothing to do" in out
    assert "--set train.steps=600" in out and "checkpoint_00000300" in out


def _silent_server():
    """A TCP server on 127.0.0.1 that accepts connections and never answers (a hung endpoint)."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted: list = []

    def serve() -> None:
        while True:
            try:
                accepted.append(server.accept()[0])
            except OSError:  # closed: the test is over
                return

    threading.Thread(target=serve, daemon=True).start()
    return server, accepted


def test_a_silent_endpoint_times_out_and_ctrl_c_ends_the_probe_at_once(tmp_path):
    import signal
    import subprocess
    import sys

    server, accepted = _silent_server()
    port = server.getsockname()[1]
    env = {**__import__("os").environ, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": SECRET,
           "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": str(tmp_path / "none"),
           "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}
    command = [sys.executable, "-m", "raytrain_fast.cli", "runs", "--storage", "s3://bkt/runs",
               "--endpoint-url", f"http://127.0.0.1:{port}"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        assert re.search(r"Timed out after 10 s trying to read s3://bkt/runs|Timeout was reached", done.stderr), done.stderr
        assert "storage.endpoint_url" in done.stderr and SECRET not in done.stderr + done.stdout

        # Ctrl-C while the request hangs. Each try gets its own silent server: a connection the
        # previous command left in a backlog could be accepted late and send the signal during the
        # next command's start-up. The signal must come well before the probe's 10 s deadline, or
        # the try proves nothing (on a starved machine, start-up alone can take that long): only
        # such a try is tried again.
        for _ in range(3):
            server.close()
            server, accepted = _silent_server()
            command[-1] = f"http://127.0.0.1:{server.getsockname()[1]}"
            started = time.monotonic()
            # The command starts with Ctrl-C at its default, as from a terminal. A process inherits
            # an ignored SIGINT, and earlier tests in the suite leave pytest's ignored: Python then
            # installs no KeyboardInterrupt handler and the signal was lost (every full run, never alone).
            process = subprocess.Popen([*command, "--debug"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       env=env, cwd=tmp_path, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
            while not accepted and time.monotonic() - started < 30:  # the probe is waiting on the silent server
                time.sleep(0.05)
            assert accepted, "the command never connected"
            if time.monotonic() - started > 6:  # too close to the deadline to tell Ctrl-C from a timeout
                process.kill()
                process.communicate()
                continue
            process.send_signal(signal.SIGINT)
            _, err = process.communicate(timeout=30)
            assert process.returncode == 130 and "raytrain-fast: error: interrupted" in err, err
            # Ctrl-C was taken while the request still hung (not after the probe gave up), and the
            # process ended without waiting for it.
            assert "Timed out" not in err and "a storage probe was still waiting" in err, err
            break
        else:
            pytest.fail("no try reached the probe within 6 s of starting: the machine is too starved to tell")
    finally:
        server.close()
