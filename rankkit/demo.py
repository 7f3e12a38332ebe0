"""The demo job: what `make demo` runs on the embedded default model."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from rankkit import models
from rankkit.prompting import build_prompt
from rankkit.runner import Runner


def answer(model_spec: str, context: str, question: str, *, max_new_tokens: int = 32, device: str = "auto") -> dict:
    """Greedy answer to (context, question) through the runner, with the prompt's size."""
    loaded = models.load(model_spec, device=device)
    prompt = build_prompt(loaded.tokenizer, context, question)
    generation = Runner(loaded.model).generate(prompt.input_ids, max_new_tokens)
    text = loaded.tokenizer.decode(generation.tokens, skip_special_tokens=True).strip()
    return {"model": loaded.model_id, "prompt_tokens": prompt.num_tokens, "answer": text}


def run_demo(out: Path, *, device: str = "auto", console: Console | None = None) -> dict:
    console = console or Console()
    out.mkdir(parents=True, exist_ok=True)
    context = ("The grass is green. The sky is blue. The sun is yellow. " * 30) + (
        "The pass key is 68247. Remember it. 68247 is the pass key. "
    ) + ("Here we go. There and back again. " * 30)
    with console.status("default model: greedy answer through the runner"):
        result = answer("default", context, "What is the pass key?", max_new_tokens=16, device=device)
    console.print(f"prompt tokens: {result['prompt_tokens']}  answer: [bold]{result['answer']}[/bold]")
    (out / "answer.json").write_text(json.dumps(result, indent=2))
    return {"out": str(out)}
