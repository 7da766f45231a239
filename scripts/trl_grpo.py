"""TRL's GRPOTrainer on the same model, data, reward and settings as an asyncflow config, for the
comparison in docs/performance.md. Not part of asyncflow: it needs `trl` (in a virtual environment
of its own: pip install torch==2.13.0 trl), and reads the asyncflow config only for the settings both
have, so each run is the same algorithm (GRPO, group-normalised advantages, token-mean PPO loss with
clip 0.2 / 0.28, no KL, one optimizer step per batch, on-policy).

    python scripts/trl_grpo.py --model DIR --train train.jsonl --eval eval.jsonl \\
        --reward asyncflow.tasks.products:reward --lenient asyncflow.tasks.products:lenient \\
        --n 8 --batch 32 --max-new-tokens 48 --lr 1e-5 --steps 40 --eval-every 10 --out trl.json

Every `--eval-every` steps (and before the first) the model answers each eval prompt greedily, as
asyncflow's evaluation does (`--lenient`: the same answers given 4x the tokens, scored by a second
function); the time that takes is left out of `train_s`. The JSON written to `--out` holds the run's
whole wall time, its training time, its peak RSS and the eval curve.
"""

from __future__ import annotations

import argparse
import importlib
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

START = time.monotonic()


def _function(path: str) -> Any:
    module, _, name = path.rpartition(":")
    return getattr(importlib.import_module(module), name)


def _rows(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _greedy(model: Any, tok: Any, prompts: list[Any], max_new_tokens: int, batch: int = 64) -> list[list[int]]:
    """Each prompt's greedy answer, as token ids (padding after its end left out)."""
    import torch

    out: list[list[int]] = []
    tok.padding_side = "left"
    for i in range(0, len(prompts), batch):
        enc = tok.apply_chat_template(prompts[i:i + batch], add_generation_prompt=True, padding=True,
                                      return_tensors="pt", return_dict=True)
        with torch.no_grad():
            ids = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        for row in ids[:, enc["input_ids"].shape[1]:].tolist():
            end = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
            out.append(row[:end])
    return out


class Evaluation:
    """Greedy accuracy on the eval rows, the time it took kept apart."""

    def __init__(self, args: argparse.Namespace, tok: Any) -> None:
        self.rows = _rows(args.eval)[: args.eval_size]
        self.tok = tok
        self.reward = _function(args.reward)
        self.lenient = _function(args.lenient) if args.lenient else None
        self.max_new_tokens = args.max_new_tokens
        self.seconds = 0.0
        self.curve: list[dict[str, Any]] = []

    def score(self, fn: Any, texts: list[str]) -> float:
        columns = {k: [r[k] for r in self.rows] for k in self.rows[0] if k != "prompt"}
        completions = [[{"role": "assistant", "content": t}] for t in texts]
        values = fn([r["prompt"] for r in self.rows], completions, **columns)
        return sum(v >= 1.0 for v in values) / len(values)

    def __call__(self, model: Any, step: int, samples: int) -> None:
        start = time.monotonic()
        train_s = start - START - self.seconds  # (before this evaluation, which is not training)
        was_training = model.training
        model.eval()
        budget = 4 * self.max_new_tokens if self.lenient is not None else self.max_new_tokens
        answers = _greedy(model, self.tok, [r["prompt"] for r in self.rows], budget)
        text = [self.tok.decode(a[: self.max_new_tokens], skip_special_tokens=True) for a in answers]
        row = {"step": step, "samples": samples, "train_s": train_s,
               "accuracy": self.score(self.reward, text)}
        if self.lenient is not None:
            row["lenient_accuracy"] = self.score(self.lenient, [self.tok.decode(a, skip_special_tokens=True)
                                                                for a in answers])
        if was_training:
            model.train()
        self.seconds += time.monotonic() - start
        row["eval_s"] = time.monotonic() - start
        self.curve.append(row)
        print(json.dumps(row), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--train", required=True)
    p.add_argument("--eval", required=True)
    p.add_argument("--eval-size", type=int, default=500)
    p.add_argument("--reward", required=True, help="module:function, TRL's signature")
    p.add_argument("--lenient", default=None, help="module:function scoring the answers given 4x the tokens")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--batch", type=int, default=32, help="completions per optimizer step")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gradient-checkpointing", choices=["true", "false"], default="true", help="TRL's default: true")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    evaluation = Evaluation(args, tok)
    config = GRPOConfig(
        output_dir=str(Path(args.out).with_suffix("")) + "-trl", per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1, num_generations=args.n, max_completion_length=args.max_new_tokens,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        max_steps=args.steps, temperature=1.0, top_p=1.0, top_k=0, beta=0.0, epsilon=0.2, epsilon_high=0.28,
        loss_type="dapo", scale_rewards="group", num_iterations=1, bf16=True, use_cpu=True,
        gradient_checkpointing=args.gradient_checkpointing == "true", logging_steps=1, save_strategy="no",
        report_to=[], seed=args.seed, dataloader_num_workers=0,
    )

    class EvalEvery(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, _args: Any, state: Any, _control: Any, **_kw: Any) -> None:
            if state.global_step % args.eval_every == 0 or state.global_step == args.steps:
                evaluation(model, state.global_step, state.global_step * args.batch)

    trainer = GRPOTrainer(model=model, reward_funcs=_function(args.reward), args=config, processing_class=tok,
                          train_dataset=Dataset.from_list(_rows(args.train)), callbacks=[EvalEvery()])
    evaluation(model, 0, 0)
    trainer.train()
    wall = time.monotonic() - START
    result = {"wall_s": wall, "train_s": wall - evaluation.seconds, "eval_s": evaluation.seconds,
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "samples": args.steps * args.batch, "curve": evaluation.curve, "args": vars(args)}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "curve"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
