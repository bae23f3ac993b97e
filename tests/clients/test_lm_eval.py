"""lm-evaluation-harness's `local-completions` model against `rollout serve`, compared with
lm-eval's own `hf` backend on the same local checkpoint: per-request log-likelihoods, a
multiple-choice task and a generate_until task (stop strings cut from the text) must agree.

lm-eval finds /tokenizer_info and /tokenize on the server and tokenizes through them."""

from __future__ import annotations

import json

import pytest
from http_checkpoint import make_checkpoint, serve

pytestmark = [pytest.mark.clients, pytest.mark.timeout(900)]

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.evaluator import simple_evaluate  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.models.openai_completions import LocalCompletionsAPI  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

MC_DOCS = [
    {"question": "The capital of france is", "choices": [" Paris", " Rome", " sunny"], "answer": 0},
    {"question": "The capital of Italy is", "choices": [" Paris", " Rome"], "answer": 1},
    {"question": "the weather in Rome is", "choices": [" warm", " Paris", " 4"], "answer": 0},
]
GEN_DOCS = [
    {"question": "what is the capital of france?", "answer": "Paris"},
    {"question": "2 + 2 = ?", "answer": "4"},
    {"question": "the weather in Paris", "answer": "sunny"},
]


def _task_dir(tmp_path, until: list[str]):
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (tmp_path / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN_DOCS))
    (tmp_path / "tiny_mc.yaml").write_text(f"""
task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    (tmp_path / "tiny_gen.yaml").write_text(f"""
task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}} Answer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: {json.dumps(until)}
  do_sample: false
  max_gen_toks: 24
metric_list:
  - metric: exact_match
""")
    return tmp_path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "model")


@pytest.fixture(scope="module")
def models(checkpoint):
    with serve(checkpoint) as url:
        api = LocalCompletionsAPI(base_url=f"{url}/v1/completions", model=str(checkpoint),
                                  batch_size=2, max_retries=1)  # fmt: skip
        hf = HFLM(pretrained=str(checkpoint), device="cpu", batch_size=1, dtype="float32")
        yield api, hf


def test_the_server_tokenizes_for_lm_eval(models):
    api, hf = models
    assert api.tokenizer_backend == "remote"
    text = "The capital of france is Paris"
    assert api.tok_encode(text) == hf.tok_encode(text)
    assert api.eot_token_id == hf.eot_token_id


def test_loglikelihoods_equal_the_hf_backend(models):
    api, hf = models
    pairs = [("The capital of france is", " Paris"), ("Question: 2 + 2 = ? Answer:", " 4"),
             ("the weather", " in Rome is warm"), ("x", " france")]  # fmt: skip
    reqs = [Instance("loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]
    ours, theirs = api.loglikelihood(reqs), hf.loglikelihood(reqs)
    assert all(lp < 0 for lp, _ in ours)  # a real score, not the 0.0 of a missing log-prob
    for (a, greedy_a), (b, greedy_b) in zip(ours, theirs, strict=True):
        assert a == pytest.approx(b, abs=1e-4) and greedy_a == greedy_b


def test_tasks_equal_the_hf_backend(models, tmp_path):
    api, hf = models
    # the random model's own greedy text picks stop strings that fire: the commonest tokens
    first = api.generate_until([Instance("generate_until", doc={}, idx=0, arguments=(
        "Question: 2 + 2 = ? Answer:", {"until": ["\n\n\n"], "max_gen_toks": 24, "do_sample": False}))])[0]  # fmt: skip
    until = [first[len(first) // 2 : len(first) // 2 + 3] or "e", "\n"]
    tasks = TaskManager(include_path=str(_task_dir(tmp_path, until)))
    results = {}
    for name, lm in (("api", api), ("hf", hf)):
        out = simple_evaluate(model=lm, tasks=["tiny_mc", "tiny_gen"],
                                      task_manager=tasks, log_samples=True)  # fmt: skip
        results[name] = out
    for task in ("tiny_mc", "tiny_gen"):
        ours = [s["resps"] for s in results["api"]["samples"][task]]
        theirs = [s["resps"] for s in results["hf"]["samples"][task]]
        if task == "tiny_mc":
            flat = lambda rs: [x[0][0] for r in rs for x in r]  # noqa: E731
            assert flat(ours) == pytest.approx(flat(theirs), abs=1e-4)
        else:
            assert ours == theirs
            assert all(u not in r[0][0] for r in ours for u in until)  # cut at the stop string
        metric = "acc,none" if task == "tiny_mc" else "exact_match,none"
        assert results["api"]["results"][task][metric] == results["hf"]["results"][task][metric]
