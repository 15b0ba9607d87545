"""A character tokenizer for the built-in arithmetic tasks: tiny vocabulary, no files, no download."""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpcrl.config.job import EnvConfig, ModelConfig
    from hpcrl.envs.base import TextEnv

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
CHARACTERS = "0123456789+-*=() "


class CharTokenizer:
    """Maps each character to one id; `<pad>`=0, `<bos>`=1, `<eos>`=2."""

    def __init__(self, characters: str = CHARACTERS):
        self.vocab = list(SPECIAL_TOKENS) + list(characters)
        self._ids = {token: index for index, token in enumerate(self.vocab)}
        self.pad_token_id, self.bos_token_id, self.eos_token_id = 0, 1, 2
        self.stop_token_ids = (self.eos_token_id,)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        try:
            ids = [self._ids[ch] for ch in text]
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the task vocabulary "
                             f"{''.join(self.vocab[len(SPECIAL_TOKENS):])!r}") from None
        return [self.bos_token_id] + ids if add_bos else ids

    def to_hf(self):
        """The same tokenizer as a Hugging Face fast tokenizer (one token per character, the same
        ids, `<bos>` first as `encode` puts it), for exported models: transformers and vLLM load it
        from tokenizer.json."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast

        pad, bos, eos = SPECIAL_TOKENS
        core = Tokenizer(models.WordLevel(dict(self._ids), unk_token=None))
        core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        core.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, self.bos_token_id)])
        core.decoder = decoders.Fuse()
        return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=pad, bos_token=bos, eos_token=eos)

    def decode(self, ids: Sequence[int], until_stop: bool = True) -> str:
        """Text up to the first `<eos>` (`until_stop`: a response; a prompt is read whole), special
        tokens dropped."""
        chars = []
        for token in ids:
            if until_stop and token in self.stop_token_ids:
                break
            if token >= len(SPECIAL_TOKENS):
                chars.append(self.vocab[token])
        return "".join(chars)


class HFTokenizer:
    """A Hugging Face tokenizer from a local model directory, behind the CharTokenizer interface."""

    def __init__(self, path: str, model_path: str | None = None):
        """`model_path`: the model's directory, whose generation_config.json lists the tokens a
        response ends at (default: `path`)."""
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.eos_token_id = self._tok.eos_token_id
        self.pad_token_id = self._tok.pad_token_id if self._tok.pad_token_id is not None else self.eos_token_id
        self.bos_token_id = self._tok.bos_token_id
        self.stop_token_ids = stop_token_ids(self.eos_token_id, Path(model_path or path))

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """`text`'s ids, `<bos>` first (with `add_bos`, where the tokenizer has one) unless the text
        already starts with it: a chat template that writes it itself (Llama-3, Mistral, Gemma) would
        otherwise give the double `<bos>` the model never saw (apply_chat_template gives one)."""
        ids = self._tok.encode(text, add_special_tokens=False)
        if not add_bos or self.bos_token_id is None or ids[:1] == [self.bos_token_id]:
            return ids
        return [self.bos_token_id] + ids

    def to_hf(self):
        return self._tok

    def chat_text(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """`messages` as the chat template renders them; with `add_generation_prompt`, ending where the
        assistant answers."""
        if self._tok.chat_template is None:
            raise ValueError(f"{self._tok.name_or_path}: the tokenizer has no chat template (tokenizer_config.json "
                             "chat_template); set chat: false (datasets or env)")
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def chat_prompt(self, user: str, system: str | None = None) -> str:
        """The conversation so far as the chat template renders it, ending where the assistant answers."""
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        return self.chat_text(messages, add_generation_prompt=True)

    def token_text(self, token: int) -> str:
        """One token as the chat template writes it (`<|eot_id|>`, `<|im_end|>`)."""
        return self._tok.decode([token], skip_special_tokens=False)

    def decode(self, ids: Sequence[int], until_stop: bool = True) -> str:
        """Text up to the first stop token (`until_stop`: a response; a chat prompt holds an end of
        turn after every message and is read whole), special tokens dropped."""
        ids = list(ids)
        end = len(ids) if not until_stop else next(
            (i for i, token in enumerate(ids) if token in self.stop_token_ids), len(ids))
        return self._tok.decode(ids[:end], skip_special_tokens=True)


def stop_token_ids(eos_token_id: int | None, model_path: Path) -> tuple[int, ...]:
    """The tokens a response ends at: the tokenizer's `<eos>`, then every `eos_token_id` of the
    model's generation_config.json, as transformers' `generate` and vLLM stop. Instruct models list
    their end of turn there (Llama-3: `<|eot_id|>` beside `<|end_of_text|>`; Qwen2.5: `<|im_end|>`
    and `<|endoftext|>`); the tokenizer's `<eos>` alone can be the other one, and responses would then
    run to their token budget."""
    path = model_path / "generation_config.json"
    listed = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    listed = [] if listed is None else [listed] if isinstance(listed, int) else listed
    return tuple(dict.fromkeys(int(t) for t in (eos_token_id, *listed) if t is not None))


def env_characters(env: TextEnv) -> str:
    """The built-in tasks' characters, then those an env's text uses that they lack (in a fixed
    order): a tiny model's vocabulary for the env, with the tasks' ids unchanged."""
    text = env.system_prompt + env.action_format + env.alphabet
    return CHARACTERS + "".join(sorted(set(text) - set(CHARACTERS)))


def load_tokenizer(model: ModelConfig, env: EnvConfig | None = None) -> CharTokenizer | HFTokenizer:
    """`model.tokenizer`, else the tokenizer of the local HF model at `model.path`, else the built-in
    tasks' character tokenizer (with the characters of the job's env, if it has one)."""
    path = model.tokenizer or model.path
    if path:
        return HFTokenizer(path, model.path)
    if env is None:
        return CharTokenizer()
    from hpcrl.envs import EnvSpec

    return CharTokenizer(env_characters(EnvSpec(env.name, env.options).build()))
