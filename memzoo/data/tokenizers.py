"""Tokenizers behind one small interface.

=============  ==========  ======  =====================================================
name           vocab_size  eos_id  source
=============  ==========  ======  =====================================================
``"byte"``     257         256     UTF-8 bytes 0..255 plus one EOS id; needs no files
``"mistral"``  32000       2       ``tokenizer.model.v1`` shipped by PyPI ``mistral-common``
                                   (the Mistral-7B v0.1 SentencePiece model), via
                                   ``sentencepiece``
anything else  len(tok)    tok's   ``transformers.AutoTokenizer.from_pretrained(name)``;
                                   works from a local directory or the HF cache (the
                                   machine has no Hub access)
=============  ==========  ======  =====================================================

``encode`` never adds BOS/EOS; :func:`memzoo.data.lm.tokenize_corpus` appends ``eos_id``
to each document. The model may pad ``vocab_size`` up (e.g. to a multiple of 64).
"""

from __future__ import annotations

import functools
import hashlib
from importlib import util as importlib_util
from pathlib import Path

import torch


class Tokenizer:
    """Common interface: ``encode``, ``decode``, ``vocab_size``, ``eos_id``, ``name``.

    ``fingerprint`` identifies the exact vocabulary (used as an on-disk cache key).
    """

    name: str
    vocab_size: int
    eos_id: int

    @property
    def fingerprint(self) -> str:
        return f"{self.name}-{self.vocab_size}"

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        raise NotImplementedError

    def decode(self, ids) -> str:
        """Text of ``ids`` (a list or 1-D tensor); the EOS id decodes to nothing."""
        raise NotImplementedError

    def encode_tensor(self, text: str) -> torch.Tensor:
        """``encode`` as a 1-D ``torch.long`` tensor (subclasses may do this faster)."""
        return torch.tensor(self.encode(text), dtype=torch.long)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def _as_list(ids) -> list[int]:
    if isinstance(ids, torch.Tensor):
        return ids.reshape(-1).tolist()
    return [int(i) for i in ids]


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes: ids 0..255 are bytes, 256 is EOS, so ``vocab_size == 257``.

    ``decode`` drops ids >= 256 (EOS or model padding) and replaces invalid UTF-8 with U+FFFD.
    """

    name = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_tensor(self, text: str) -> torch.Tensor:
        data = text.encode("utf-8")
        if not data:
            return torch.empty(0, dtype=torch.long)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

    def decode(self, ids) -> str:
        return bytes(i for i in _as_list(ids) if 0 <= i < 256).decode("utf-8", errors="replace")


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``.model`` file; ``encode`` adds neither BOS nor EOS."""

    def __init__(self, model_file: str | Path, name: str | None = None):
        import sentencepiece as spm

        self.model_file = Path(model_file)
        self._sp = spm.SentencePieceProcessor(model_file=str(self.model_file))
        self.name = name or self.model_file.name
        self.vocab_size = int(self._sp.get_piece_size())
        eos = int(self._sp.eos_id())
        if eos < 0:
            raise ValueError(f"SentencePiece model {self.model_file} defines no EOS id")
        self.eos_id = eos
        self._fp = hashlib.sha1(self.model_file.read_bytes()).hexdigest()[:12]

    @property
    def fingerprint(self) -> str:
        return f"{self.name}-{self.vocab_size}-{self._fp}"

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text, out_type=int))

    def decode(self, ids) -> str:
        return self._sp.decode([i for i in _as_list(ids) if i != self.eos_id])


def mistral_tokenizer_path() -> Path:
    """Path of the 32k Mistral SentencePiece model shipped inside PyPI ``mistral-common``.

    Raises:
        FileNotFoundError: the package or file is missing (message says how to fix it).
    """
    spec = importlib_util.find_spec("mistral_common")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The 'mistral' tokenizer needs the PyPI package mistral-common (it ships "
            "mistral_common/data/tokenizer.model.v1): pip install 'mistral-common>=1.5'"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / "data" / "tokenizer.model.v1"
        if path.is_file():
            return path
    raise FileNotFoundError(
        "mistral-common is installed but mistral_common/data/tokenizer.model.v1 (the 32000-piece "
        f"SentencePiece model) is missing under {list(spec.submodule_search_locations)}; "
        "reinstall it: pip install --force-reinstall 'mistral-common>=1.5'"
    )


class HFTokenizer(Tokenizer):
    """``transformers.AutoTokenizer.from_pretrained(name)``; ``encode`` adds no special tokens."""

    def __init__(self, name: str, **kwargs):
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(name, **kwargs)
        except Exception as e:  # OSError / ValueError / HTTP errors, depending on version
            raise ValueError(
                f"Unknown tokenizer {name!r}: not 'byte' or 'mistral', and "
                f"transformers.AutoTokenizer.from_pretrained({name!r}) failed ({type(e).__name__}: {e}). "
                "Without network access it must be a local directory or already in the HF cache."
            ) from e
        self.name = name
        self.vocab_size = len(self._tok)
        eos = self._tok.eos_token_id
        if eos is None:
            eos = self._tok.sep_token_id
        if eos is None:
            raise ValueError(f"HF tokenizer {name!r} has neither an EOS nor a SEP token")
        self.eos_id = int(eos)

    @property
    def fingerprint(self) -> str:
        return f"hf-{self.name}-{self.vocab_size}-{type(self._tok).__name__}"

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False, verbose=False))

    def decode(self, ids) -> str:
        return self._tok.decode(_as_list(ids), skip_special_tokens=True)


@functools.lru_cache(maxsize=8)
def get_tokenizer(name: str = "byte") -> Tokenizer:
    """Return the tokenizer called ``name`` (``"byte"``, ``"mistral"`` or an HF name/path).

    Instances are cached, so repeated calls are cheap.
    """
    if name == "byte":
        return ByteTokenizer()
    if name == "mistral":
        return SentencePieceTokenizer(mistral_tokenizer_path(), name="mistral")
    return HFTokenizer(name)
