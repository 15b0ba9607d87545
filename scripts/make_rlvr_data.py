"""Generate the shipped RLVR data: arithmetic word problems, small Python tasks, and their tokenizer.

Deterministic (a fixed seed), small, and made here so that nothing is downloaded:
- math_train.jsonl / math_eval.jsonl: templated word problems over two numbers from 1 to 9 (sums
  and differences), the answer in `answer`.
- code_train.jsonl / code_eval.jsonl: "write a function" tasks, each with assert tests (JSON).
- tokenizer/: a byte-level BPE trained with Hugging Face `tokenizers` on all of the above
  (digits one token each, as Llama's and Qwen's tokenizers split them), saved as tokenizer.json
  with a chat template and <pad>/<bos>/<eos>, so these jobs use the real HF tokenizer path.
- format-model/: the tiny policy of jobs/tiny_rlvr_mix.yaml after a few hundred supervised steps
  on bare sums and differences ("3 + 4 = ?" -> `\\boxed{7}` then <eos>): it answers in the format
  and can add, but has never read a word problem (eval reward 0.16 on them; RLVR teaches it to,
  as RL after SFT does: reward from scratch would be too sparse for a tiny model on CPU). Its
  tokenizer is beside it.

    .venv/bin/python scripts/make_rlvr_data.py [--out data/rlvr] [--no-model]
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Ann", "Ben", "Cara", "Dan", "Eve", "Finn", "Gia", "Hal", "Ivy", "Joe", "Kim", "Leo", "Mia", "Ned"]
ITEMS = ["apples", "books", "coins", "pens", "cards", "shells", "stamps", "marbles", "cookies", "stickers"]
MATH_TEMPLATES = [   # (template, operation)
    ("{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?", "+"),
    ("There are {a} {item} in a box and {b} {item} on the table. How many {item} are there in all?", "+"),
    ("{name} had {c} {item} and gave away {b}. How many {item} are left?", "-"),
    ("{name} finds {a} {item} and then {b} {item} more. How many {item} did {name} find?", "+"),
    ("{name} has {a} {item} and {other} has {b} {item}. How many {item} do they have together?", "+"),
]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIALS = ["<pad>", "<bos>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>"]
CODE_TASKS = [   # (name, description, body, argument lists)
    ("add", "returns the sum of a and b", "return a + b", [(1, 2), (0, 0), (-3, 5), (10, 7)]),
    ("sub", "returns a minus b", "return a - b", [(5, 2), (0, 3), (7, 7), (-1, -4)]),
    ("mul", "returns the product of a and b", "return a * b", [(3, 4), (0, 9), (-2, 5), (7, 7)]),
    ("larger", "returns the larger of a and b", "return max(a, b)", [(3, 4), (9, 1), (-2, -5), (6, 6)]),
    ("smaller", "returns the smaller of a and b", "return min(a, b)", [(3, 4), (9, 1), (-2, -5), (6, 6)]),
    ("double", "returns twice x", "return 2 * x", [(0,), (4,), (-3,), (11,)]),
    ("square", "returns x squared", "return x * x", [(0,), (3,), (-4,), (12,)]),
    ("is_even", "returns True when x is even", "return x % 2 == 0", [(0,), (3,), (8,), (-5,)]),
    ("absolute", "returns the absolute value of x", "return abs(x)", [(0,), (3,), (-8,), (-1,)]),
    ("first", "returns the first element of the list xs", "return xs[0]", [([1, 2],), ([5],), ([9, 8, 7],)]),
    ("last", "returns the last element of the list xs", "return xs[-1]", [([1, 2],), ([5],), ([9, 8, 7],)]),
    ("total", "returns the sum of the list xs", "return sum(xs)", [([1, 2],), ([],), ([4, 4, 4],)]),
    ("count", "returns the number of elements of the list xs", "return len(xs)", [([1, 2],), ([],), ([4, 4, 4],)]),
    ("reverse", "returns the string s reversed", "return s[::-1]", [("ab",), ("",), ("abc",)]),
    ("shout", "returns the string s in upper case", "return s.upper()", [("ab",), ("",), ("Hi",)]),
    ("plus_one", "returns x plus one", "return x + 1", [(0,), (4,), (-1,), (99,)]),
    ("minus_one", "returns x minus one", "return x - 1", [(0,), (4,), (-1,), (99,)]),
    ("half", "returns x divided by 2 with integer division", "return x // 2", [(0,), (5,), (8,), (-3,)]),
    ("is_positive", "returns True when x is greater than zero", "return x > 0", [(0,), (5,), (-2,)]),
    ("middle", "returns the middle one of three numbers a, b and c", "return sorted([a, b, c])[1]",
     [(1, 2, 3), (3, 1, 2), (5, 5, 1)]),
]


def math_rows(count: int, rng: random.Random, seen: set[str]) -> list[dict]:
    """`count` problems none of which is in `seen` (then added to it): no evaluation problem is also
    a training one."""
    rows = []
    while len(rows) < count:
        template, op = rng.choice(MATH_TEMPLATES)
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        name, other = rng.sample(NAMES, 2)
        c = a + b   # the subtraction's start, so that the answer is a
        text = template.format(name=name, other=other, item=rng.choice(ITEMS), a=a, b=b, c=c)
        if text in seen:
            continue
        seen.add(text)
        rows.append({"prompt": text, "answer": str(a + b if op == "+" else a)})
    return rows


def code_rows() -> tuple[list[dict], list[dict]]:
    rows = []
    for name, description, body, cases in CODE_TASKS:
        arguments = {1: "x", 2: "a, b", 3: "a, b, c"}[len(cases[0])] if name not in (
            "first", "last", "total", "count", "reverse", "shout") else ("s" if name in ("reverse", "shout") else "xs")
        namespace: dict = {}
        exec(f"def {name}({arguments}):\n    {body}\n", namespace)
        tests = [f"assert {name}({', '.join(map(repr, case))}) == {namespace[name](*case)!r}" for case in cases]
        prompt = f"Write a Python function {name}({arguments}) that {description}."
        rows.append({"prompt": prompt, "tests": {"tests": tests}, "solution": f"def {name}({arguments}):\n    {body}\n"})
    return rows[:16], rows[16:]


def train_tokenizer(corpus: list[str], out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token=None))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                  pre_tokenizers.ByteLevel(add_prefix_space=False)])
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=640, special_tokens=SPECIALS, show_progress=False,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    hf = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(out)


SYSTEM = "Answer with the number in \\boxed{}."
FORMAT_MODEL = {"arch": "qwen2", "hidden_size": 96, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2,
                "intermediate_size": 256, "max_position_embeddings": 64}


def teach_format(rows: list[dict], tokenizer_dir: Path, out: Path, rng: random.Random, steps: int = 800,
                 batch: int = 32) -> None:
    """Supervised steps on bare sums and differences ("3 + 4 = ?" -> \\boxed{7}): the answer's form and
    arithmetic, never a word problem (the policy's eval reward on them starts at 0.16)."""
    import torch

    from hpcrl.config.job import ModelConfig
    from hpcrl.data.tokenizer import HFTokenizer
    from hpcrl.engines.hf_model import random_model
    from hpcrl.engines.model_files import save_model

    tokenizer = HFTokenizer(str(tokenizer_dir))
    torch.manual_seed(0)
    model = random_model(ModelConfig(**FORMAT_MODEL), tokenizer, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        ids, targets = [], []
        for _ in range(batch):
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            question, result = (f"{a} + {b} = ?", a + b) if rng.random() < 0.5 else (f"{a + b} - {b} = ?", a)
            prompt = tokenizer.encode(tokenizer.chat_prompt(question, SYSTEM))
            answer = tokenizer.encode(f"\\boxed{{{result}}}", add_bos=False) + [tokenizer.eos_token_id]
            ids.append(prompt + answer)
            targets.append([-100] * len(prompt) + answer)
        width = max(map(len, ids))
        input_ids = torch.tensor([x + [tokenizer.pad_token_id] * (width - len(x)) for x in ids])
        labels = torch.tensor([y + [-100] * (width - len(y)) for y in targets])
        mask = (torch.arange(width)[None] < torch.tensor([len(x) for x in ids])[:, None]).long()
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    save_model(model, out)
    tokenizer.to_hf().save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/rlvr")
    parser.add_argument("--no-model", action="store_true", help="the data and the tokenizer only (seconds)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(20261204)
    seen: set[str] = set()
    files = {"math_train.jsonl": math_rows(2000, rng, seen), "math_eval.jsonl": math_rows(128, rng, seen)}
    files["code_train.jsonl"], files["code_eval.jsonl"] = code_rows()
    for name, rows in files.items():
        (out / name).write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
    corpus = [row["prompt"] for rows in files.values() for row in rows]
    corpus += [f"\\boxed{{{row['answer']}}}" for row in files["math_train.jsonl"]]
    corpus += [row["solution"] for row in files["code_train.jsonl"] + files["code_eval.jsonl"]]
    train_tokenizer(corpus, out / "tokenizer")
    if not args.no_model:
        teach_format(files["math_train.jsonl"], out / "tokenizer", out / "format-model", rng)
    print(f"wrote {', '.join(sorted(files))}, tokenizer/{'' if args.no_model else ' and format-model/'} to {out}")


if __name__ == "__main__":
    main()
