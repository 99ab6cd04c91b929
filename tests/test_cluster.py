"""cluster.yaml is a valid Ray cluster launcher config, and the cluster and single-GPU commands of
docs/cluster.md (and the README's short version) use files, presets and config keys that exist. No cloud calls: `ray up` runs the same
schema and default-filling checks before it talks to AWS."""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_YAML = ROOT / "cluster.yaml"


def cluster_config() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def ray_schema() -> dict:
    import ray.autoscaler

    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def doc_section(page: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", (ROOT / page).read_text(), flags=re.S | re.M)
    assert match, f"{page} has no '## {title}' section"
    return match.group(1)


def commands(section: str) -> list[str]:
    """Shell commands of the section's bash blocks, continuation lines joined, comments dropped."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line:
                lines.append(line)
    return lines


def test_cluster_yaml_matches_the_schema_shipped_with_ray():
    jsonschema.validate(cluster_config(), ray_schema())


def test_the_schema_check_catches_a_misspelt_key():
    broken = cluster_config()
    broken["available_node_types"]["gpu_worker"]["min_worker"] = broken["available_node_types"]["gpu_worker"].pop("min_workers")
    with pytest.raises(jsonschema.ValidationError, match="min_worker"):
        jsonschema.validate(broken, ray_schema())


def test_cluster_yaml_passes_the_checks_ray_up_runs_before_calling_aws():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(copy.deepcopy(cluster_config()))  # merged with Ray's AWS defaults, as `ray up` does
    validate_config(config)
    assert config["provider"]["type"] == "aws"
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"] == {"CPU": 0}, "the head runs drivers only: no training or data tasks on it"
    workers = [t for name, t in config["available_node_types"].items() if name != config["head_node_type"]]
    assert len(workers) == 1
    (gpu,) = workers
    # The job checks the cluster's GPUs when it starts (use_gpu: true in the GPU presets): the pool
    # must be up before the job, so it is fixed.
    assert gpu["min_workers"] == gpu["max_workers"] == config["max_workers"] > 0
    assert gpu["node_config"]["InstanceType"].startswith(("g", "p")), "GPU instances for the workers"


def test_node_configs_use_only_ec2_run_instances_fields():
    import botocore.session

    fields = botocore.session.get_session().get_service_model("ec2").operation_model("RunInstances").input_shape.members
    for name, node_type in cluster_config()["available_node_types"].items():
        unknown = set(node_type["node_config"]) - set(fields)
        assert not unknown, f"{name}: not RunInstances parameters: {unknown}"


def test_setup_installs_this_checkout_with_the_ray_and_torch_versions_the_project_uses():
    import ray

    config = cluster_config()
    assert config["file_mounts"] == {"~/raytrain_fast": "."}
    setup = "\n".join(config["setup_commands"])
    assert "-e ~/raytrain_fast" in setup
    # Client and cluster must run the same Ray; this is the Ray the project is tested with.
    assert re.search(r'"ray\[default,train,tune,data\]==([\w.]+)"', setup).group(1) == ray.__version__
    pinned_torch = re.search(r"^torch==(\S+)", (ROOT / "constraints-cpu.txt").read_text(), flags=re.M).group(1)
    assert f'"torch=={pinned_torch}"' in setup
    images = {t["node_config"]["ImageId"] for t in config["available_node_types"].values()}
    assert len(images) == 1, "one AMI for every node type"
    # The job server shows each job's runtime env (credentials): never on a public interface.
    assert "--dashboard-host=127.0.0.1" in " ".join(config["head_start_ray_commands"])


def pretrain_args(command: str) -> list[str] | None:
    words = shlex.split(command.replace("$PWD", str(ROOT)))
    if "jobs/pretrain.py" not in words:
        return None
    return words[words.index("jobs/pretrain.py") + 1:]


@pytest.mark.parametrize("page, title", [
    ("docs/cluster.md", "Run on a cluster"), ("docs/cluster.md", "Single GPU node"), ("README.md", "Next steps"),
])
def test_cluster_doc_job_commands_use_real_files_presets_and_config_keys(page, title):
    from raytrain_fast.cli import build_parser
    from raytrain_fast.config import load_config, validate

    section = doc_section(page, title)
    lines = commands(section)
    jobs = [args for line in lines if (args := pretrain_args(line)) is not None]
    assert jobs, f"no `python jobs/pretrain.py` command in {page} '{title}'"
    for line in lines:
        for path in re.findall(r"\b((?:jobs|tests)/\w+\.py|cluster\.yaml)\b", line):
            assert (ROOT / path).exists(), f"{page} '{title}' uses {path}, which does not exist"
        if line.startswith("ray job submit"):
            assert "--working-dir ." in line and "python jobs/pretrain.py" in line
    for args in jobs:
        parsed = build_parser().parse_args(["pretrain", *args])
        config = load_config(parsed.config, parsed.overrides, name=parsed.name)  # a preset name or a real path
        validate(config)
    for name in re.findall(r"`--config ([\w./-]+)`", section):
        if name.endswith(".yaml") and not (ROOT / name).exists():
            continue  # the user's own file, named as an example
        load_config(name)


def test_cluster_doc_runtime_env_line_carries_only_the_credentials_that_are_set():
    (line,) = [line for line in commands(doc_section("docs/cluster.md", "Run on a cluster")) if line.startswith("RUNTIME_ENV=")]
    env = {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": "secret/with+chars'\"", "WANDB_API_KEY": "wandb-key",
        "UNRELATED_SECRET": "not sent",
    }
    out = subprocess.run(["bash", "-c", f'{line}\nprintf %s "$RUNTIME_ENV"'], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == {
        "env_vars": {k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "WANDB_API_KEY")}
    }
