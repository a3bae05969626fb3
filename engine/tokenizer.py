"""Tokenizer: text <-> token ids, the chat template, and incremental detokenization."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from engine.chat_template import ChatTemplate, ChatTemplateError, compile_template

_CONTROL_TOKEN = 3  # GGUF token_type of special tokens such as <|im_end|>


def write_tokenizer_files(meta: dict, out_dir: Path) -> None:
    """Builds tokenizer.json + tokenizer_config.json from a GGUF's tokenizer.ggml.* fields."""
    model_kind = meta["tokenizer.ggml.model"].contents()
    if model_kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model_kind!r} is not supported (gpt2 BPE only)")
    tokens = meta["tokenizer.ggml.tokens"].contents()
    token_types = meta["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"].contents()]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    tok = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = meta.get("tokenizer.ggml.pre")
    if pre is not None and pre.contents() in ("smollm", "starcoder", "refact"):
        # These vocabularies split digits one by one before the GPT-2 byte-level regex.
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    specials = [t for t, kind in zip(tokens, token_types, strict=True) if kind == _CONTROL_TOKEN]
    tok.add_special_tokens(specials)
    tok.save(str(out_dir / "tokenizer.json"))

    def token(key: str) -> str | None:
        field_ = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if field_ is None else tokens[int(field_.contents())]

    config = {
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("padding"),
        "add_bos_token": bool(meta["tokenizer.ggml.add_bos_token"].contents())
        if "tokenizer.ggml.add_bos_token" in meta
        else False,
        "chat_template": meta["tokenizer.chat_template"].contents()
        if "tokenizer.chat_template" in meta
        else None,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


@dataclass(slots=True)
class TextTokenizer:
    """The model's tokenizer as the engine uses it; loaded from a HF-format directory."""

    hf: Tokenizer
    eos_token_id: int
    bos_token_id: int | None
    add_bos_token: bool
    chat_template: str | None

    @classmethod
    def load(cls, model_dir: Path) -> TextTokenizer:
        hf = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template_file = model_dir / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else None
        model_config = json.loads((model_dir / "config.json").read_text())

        def token_id(key: str) -> int | None:
            value = config.get(key)
            if isinstance(value, dict):  # older configs store {"content": "<s>", ...}
                value = value.get("content")
            return hf.token_to_id(value) if value else model_config.get(f"{key}_id")

        eos = token_id("eos_token")
        if eos is None:
            raise ValueError(f"{model_dir}: no eos token in tokenizer_config.json or config.json")
        return cls(
            hf=hf,
            eos_token_id=eos,
            bos_token_id=token_id("bos_token"),
            add_bos_token=bool(config.get("add_bos_token", False)),
            chat_template=template or config.get("chat_template"),
        )

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """add_special_tokens: the BOS the model's config asks for (a chat template writes
        its own)."""
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def chat(self) -> ChatTemplate:
        """The model's chat template, compiled once (compile_template caches by source)."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; send a plain prompt")
        return compile_template(
            self.chat_template, self._token_text(self.bos_token_id),
            self._token_text(self.eos_token_id),
        )  # fmt: skip

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **options: Any
    ) -> str:
        """options: ChatTemplate.render's (continue_final_message, variables)."""
        return self.chat().render(messages, add_generation_prompt=add_generation_prompt,
                                  **options)  # fmt: skip

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.hf.id_to_token(token_id) or ""


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything.

    A byte-level BPE token can end in the middle of a UTF-8 character: text is only released
    once the decoded tail no longer ends in U+FFFD.
    """

    tokenizer: TextTokenizer
    token_ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""

    def add(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        prefix = self.tokenizer.decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.token_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta
