"""Prompt files read with Hugging Face `datasets`, one per domain, into (prompt text, reference, domain).

Local files only (jsonl, json, parquet, arrow, csv; `datasets.load_dataset(<format>, data_files=...)`),
so a job never downloads anything at run time. Each row's user turn is the dataset's `template`
formatted over its columns; with `chat: true` the tokenizer's chat template wraps it (after the
system prompt) and ends where the assistant answers, as the model will see it at inference.
"""
from __future__ import annotations

from pathlib import Path

from hpcrl.config.job import DatasetConfig
from hpcrl.data.tasks import Prompt

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}


def read_rows(config: DatasetConfig) -> list[dict]:
    """The file's rows as dicts, through `datasets` (its cache under the system's temporary directory)."""
    path = Path(config.path)
    if not path.is_file():
        raise FileNotFoundError(f"datasets[{config.tag}].path: {path} is not a file")
    if path.suffix not in FORMATS:
        raise ValueError(f"datasets[{config.tag}].path: {path.suffix or 'no suffix'}: use one of {', '.join(FORMATS)}")
    import datasets

    datasets.disable_progress_bars()
    table = datasets.load_dataset(FORMATS[path.suffix], data_files=str(path), split="train")
    missing = {config.prompt_key, config.answer_key} - set(table.column_names)
    if missing:
        raise ValueError(f"datasets[{config.tag}]: {path} has no column {sorted(missing)} (its columns: "
                         f"{', '.join(table.column_names)}); set prompt_key and answer_key")
    return table.to_list()


def dataset_prompts(config: DatasetConfig, tokenizer) -> list[Prompt]:
    """Every row of the file as a Prompt of the dataset's domain."""
    if config.chat and not hasattr(tokenizer, "chat_prompt"):
        raise ValueError(f"datasets[{config.tag}].chat: the built-in character tokenizer has no chat template; set "
                         "model.tokenizer (a Hugging Face tokenizer with one) or chat: false")
    prompts = []
    for index, row in enumerate(read_rows(config)):
        try:
            user = config.template.format(**{**row, "prompt": row[config.prompt_key]})
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"datasets[{config.tag}].template: row {index + 1} of {config.path}: {exc!r}") from None
        text = tokenizer.chat_prompt(user, config.system_prompt) if config.chat else (
            f"{config.system_prompt}\n{user}" if config.system_prompt else user)
        reference = row[config.answer_key]
        prompts.append(Prompt(text, reference if isinstance(reference, str) else _as_json(reference), config.tag))
    return prompts


def _as_json(value) -> str:
    import json

    return json.dumps(value)
