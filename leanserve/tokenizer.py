"""The model's tokenizer: a ``tokenizers.Tokenizer`` plus special-token ids, stop tokens and chat template."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from leanserve.errors import InvalidParameterError, ModelLoadError
from leanserve.gguf_vocab import CHAR_TO_BYTE, END_OF_TURN_TOKENS, gguf_tokenizer_kwargs

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

_LONG_TEXT = 32768  # characters: longer texts are encoded with the GIL released
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _never_shrinks(normalizer: dict[str, Any] | None) -> bool:
    """Whether a ``tokenizers`` normalizer (its JSON state) never shortens a text: none, a prepended string, a
    space spelled as ``▁`` (SentencePiece), or a sequence of those."""
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_never_shrinks(n) for n in normalizer.get("normalizers", []))
    if kind == "Replace":
        return normalizer.get("pattern") == {"String": " "} and normalizer.get("content") == "▁"
    return kind == "Prepend"


def _keeps_all_text(pre_tokenizer: dict[str, Any] | None) -> bool:
    """Whether a pre-tokenizer (its JSON state) passes every byte of the text on: byte-level, Metaspace, a
    split that keeps its delimiters, digits or punctuation, or a sequence of those (``WhitespaceSplit`` and
    ``Split(behavior="Removed")`` drop text)."""
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_all_text(p) for p in pre_tokenizer.get("pretokenizers", []))
    if kind == "Split":
        return pre_tokenizer.get("behavior") != "Removed"
    return kind in ("ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts")


def _spells_every_byte(backend: Backend) -> bool:
    """Whether each byte of a text ends up in some token's spelling: the normalizer never shortens the text,
    the pre-tokenizer drops nothing, no added token strips the spaces around it (``lstrip``/``rstrip``), and
    the model has byte fallback or no unknown token (a fused ``<unk>`` stands for any number of bytes)."""
    def state(part: Any) -> dict[str, Any] | None:
        return json.loads(part.__getstate__()) if part is not None else None

    if not (_never_shrinks(state(backend.normalizer)) and _keeps_all_text(state(backend.pre_tokenizer))):
        return False
    if any(t.lstrip or t.rstrip for t in backend.get_added_tokens_decoder().values()):
        return False
    model = backend.model
    if isinstance(model, BPE):  # its two flags, not a JSON dump of the whole vocabulary and merges
        return bool(model.byte_fallback) or model.unk_token is None
    state = json.loads(model.__getstate__())
    return bool(state.get("byte_fallback")) or state.get("unk_token") is None


class Tokenizer:
    """Text <-> token ids for one model.

    Built from GGUF metadata (:meth:`from_gguf`) or an HF folder (:meth:`from_dir`).

    Attributes:
        vocab_size: number of token ids (model vocabulary plus added tokens).
        bos_token_id: beginning-of-sequence id, or None if the model has none.
        eos_token_id: end-of-sequence id.
        stop_token_ids: ids that end generation: EOS plus the end-of-turn control tokens the vocabulary has.
        add_bos: whether :meth:`encode` prepends BOS (when asked to add special tokens).
        chat_template: the Jinja chat template, or None.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        kind: str,
        vocab_size: int,
        bos_token_id: int | None,
        eos_token_id: int,
        stop_token_ids: frozenset[int],
        add_bos: bool,
        chat_template: str | None,
        special_ids: frozenset[int],
        special_tokens: Mapping[str, str] | None = None,
    ) -> None:
        """Wrap ``backend``. ``kind`` is how token strings spell bytes: ``"byte_level"`` (GPT-2 alphabet),
        ``"sentencepiece"`` (``▁`` for space, ``<0xAB>`` byte tokens) or ``"plain"``. ``special_ids`` are the
        ids :meth:`decode` may skip; ``special_tokens`` maps bos_token/eos_token/... to their text for the
        chat template.

        Raises:
            ModelLoadError: ``chat_template`` is not valid Jinja.
        """
        self._backend = backend
        self._kind = kind
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.stop_token_ids = stop_token_ids
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._special_ids = special_ids
        self._special_tokens = dict(special_tokens or {})
        self._added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        self._bytes: list[bytes] | None = None
        self._max_token_bytes: int | None = None
        self._bound_holds = kind in ("byte_level", "sentencepiece") and _spells_every_byte(backend)
        # Compiled now, so that a broken template fails the load (ModelLoadError), not a request.
        self._template = _compile(chat_template) if chat_template is not None else None

    # ----------------------------------------------------------------------------------------------- builders
    @classmethod
    def from_gguf(cls, reader_or_fields: Any) -> Tokenizer:
        """Build from GGUF ``tokenizer.*`` metadata.

        Args:
            reader_or_fields: a ``gguf.GGUFReader``, or a mapping of metadata keys to ``gguf.ReaderField``
                or to plain values (``str``, ``int``, ``list``...).

        Raises:
            ModelLoadError: no tokenizer in the metadata, or an unsupported tokenizer model / pre-tokenizer.
        """
        fields = getattr(reader_or_fields, "fields", reader_or_fields)

        def meta(key: str, default: Any = None) -> Any:
            value = fields.get(key)
            if value is None:
                return default
            if hasattr(value, "contents"):
                value = value.contents()
            return value.item() if hasattr(value, "item") else value

        return cls(**gguf_tokenizer_kwargs(meta))

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Build from an HF folder: ``tokenizer.json``, plus ``tokenizer_config.json`` (special tokens,
        ``add_bos_token``, ``chat_template``), ``chat_template.jinja`` and ``generation_config.json``
        (more EOS ids) when present.

        Raises:
            ModelLoadError: ``tokenizer.json`` missing or unreadable, or no EOS token can be found.
        """
        path = os.fspath(path)
        try:
            backend = Backend.from_file(os.path.join(path, "tokenizer.json"))
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise ModelLoadError(f"cannot read {path}/tokenizer.json: {exc}") from exc
        config, gen = _read_json(path, "tokenizer_config.json"), _read_json(path, "generation_config.json")

        def token(name: str) -> tuple[str | None, int | None]:
            value = config.get(name)
            text = value.get("content") if isinstance(value, dict) else value
            return text, (backend.token_to_id(text) if text is not None else None)

        special = {name: token(name) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        gen_eos = gen.get("eos_token_id")
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        bos, eos = special["bos_token"][1], special["eos_token"][1]
        if eos is None:
            eos = gen_eos[0] if gen_eos else None
        if eos is None:
            raise ModelLoadError(f"{path}: no eos_token in tokenizer_config.json or generation_config.json")
        added = backend.get_added_tokens_decoder()
        special_ids = frozenset(i for i, t in added.items() if t.special)
        add_bos = config.get("add_bos_token")
        if add_bos is None:  # the post-processor of tokenizer.json decides: does it prepend BOS?
            ids = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos is not None and len(ids) > 1 and ids[0] == bos
        stop = {eos, *gen_eos} | {i for i in special_ids if added[i].content in END_OF_TURN_TOKENS}
        decoder = backend.decoder.__getstate__().decode() if backend.decoder is not None else ""
        kind = (
            "byte_level"
            if "ByteLevel" in decoder
            else "sentencepiece"
            if "ByteFallback" in decoder or "Metaspace" in decoder
            else "plain"
        )
        return cls(
            backend,
            kind=kind,
            vocab_size=backend.get_vocab_size(with_added_tokens=True),
            bos_token_id=bos,
            eos_token_id=eos,
            stop_token_ids=frozenset(stop),
            add_bos=bool(add_bos),
            chat_template=_dir_chat_template(path, config),
            special_ids=special_ids,
            special_tokens={k: v[0] for k, v in special.items() if v[0] is not None},
        )

    # ---------------------------------------------------------------------------------------------- encoding
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Special-token text (e.g. ``<|im_start|>``) encodes to its single id.
        BOS is prepended only when ``add_bos`` and ``add_special_tokens``.

        Raises:
            InvalidParameterError: ``text`` is not a string or not valid Unicode (e.g. a lone surrogate).
        """
        if not isinstance(text, str):
            raise InvalidParameterError("prompt", f"text to tokenize must be a string, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidParameterError("prompt", f"the text is not valid Unicode: {e.reason} at {e.start}") from None
        if len(text) < _LONG_TEXT:
            ids = self._backend.encode(text, add_special_tokens=False).ids
        else:  # encode_batch releases the GIL: a long prompt does not stall the server's event loop
            ids = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def min_num_tokens(self, text: str, add_special_tokens: bool = True) -> int:
        """A lower bound on ``len(self.encode(text, add_special_tokens))``, in O(len(text)) without tokenizing:
        the text's UTF-8 bytes over the longest token's bytes (:meth:`token_bytes`), plus BOS. Exact as a bound
        for byte-level and SentencePiece vocabularies where each byte of the text is spelled by some token
        (no shrinking normalizer, no pre-tokenizer that drops text, no space-stripping added token, no fused
        ``<unk>``); 0 for other tokenizers."""
        if not self._bound_holds:
            return 0
        if self._max_token_bytes is None:
            self._max_token_bytes = max(1, max(len(self.token_bytes(i)) for i in range(self.vocab_size)))
        try:
            n = -(-len(text.encode("utf-8")) // self._max_token_bytes)
        except UnicodeEncodeError:
            return 0  # encode() reports it
        return n + int(add_special_tokens and self.add_bos and self.bos_token_id is not None)

    def get_vocab(self) -> dict[str, int]:
        """Token string -> id, added tokens included (as ``tokenizers.Tokenizer.get_vocab``)."""
        return self._backend.get_vocab(with_added_tokens=True)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; special tokens (:meth:`is_special`) are dropped if ``skip_special_tokens``.

        Incomplete UTF-8 sequences decode to U+FFFD (use :meth:`token_bytes` for streaming)."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw UTF-8 bytes token ``token_id`` stands for: a byte-level token that is part of a multi-byte
        character gives just its bytes; SentencePiece ``▁`` is a space and ``<0xE4>`` is ``b"\\xe4"``; an
        added or special token gives its text, encoded.

        Raises:
            IndexError: ``token_id`` is outside ``[0, vocab_size)``.
        """
        if self._bytes is None:
            self._bytes = [self._spell(i) for i in range(self.vocab_size)]
        if not 0 <= token_id < self.vocab_size:
            raise IndexError(f"token id {token_id} outside [0, {self.vocab_size})")
        return self._bytes[token_id]

    def _spell(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        tok = self._backend.id_to_token(token_id)
        if tok is None:
            return b""
        if self._kind == "byte_level":
            try:
                return bytes(CHAR_TO_BYTE[c] for c in tok)
            except KeyError:
                return tok.encode()
        if self._kind == "sentencepiece":
            m = _BYTE_TOKEN.fullmatch(tok)
            return bytes([int(m.group(1), 16)]) if m else tok.replace("▁", " ").encode()
        return tok.encode()

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a special (control) token, e.g. ``<|im_start|>``, BOS or EOS."""
        return token_id in self._special_ids

    # ------------------------------------------------------------------------------------------ chat template
    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` (dicts with ``role`` and ``content``) with the model's chat template, the way
        transformers does (sandboxed Jinja, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``,
        ``strftime_now``, a non-escaping ``tojson``; variables ``messages``, ``add_generation_prompt``, the
        special tokens ``bos_token``/``eos_token``/... and ``kwargs``). A ``content`` given as a list of parts
        ``[{"type": "text", "text": ...}]`` is joined into one string first.

        Raises:
            InvalidParameterError: (param ``"messages"``) the model has no chat template, a message is
                malformed or has a non-text part, or the template rejects the conversation.
        """
        if self._template is None:
            raise InvalidParameterError("messages", "this model has no chat template; use a plain prompt")
        chat = [_flatten_message(m) for m in messages]
        variables = {"tools": None, "documents": None, **self._special_tokens, **kwargs}
        try:
            return self._template.render(
                messages=chat, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as exc:
            raise InvalidParameterError("messages", f"chat template error: {exc}") from exc


def _flatten_message(message: Any) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise InvalidParameterError("messages", f"a message must be an object, got {type(message).__name__}")
    message = dict(message)
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if (
                not isinstance(part, Mapping)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise InvalidParameterError("messages", f"unsupported content part {part!r}: only text parts")
            texts.append(part["text"])
        message["content"] = "".join(texts)
    return message


def _compile(source: str) -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ModelLoadError(f"the model's chat template does not compile: {exc}") from exc


def _read_json(folder: str, name: str) -> dict[str, Any]:
    file = os.path.join(folder, name)
    if not os.path.isfile(file):
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {file}: {exc}") from exc


def _dir_chat_template(folder: str, config: dict[str, Any]) -> str | None:
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template") or _read_json(folder, "chat_template.json").get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template
