"""One value for every codec setting of a run: :class:`Codec`, given once to ``rj.Swarm`` (which
``rj.OuterSync`` reads it from) and to ``rj.compress.simulated``. Jax-free."""

from __future__ import annotations

import dataclasses
from typing import Any

from ._formats import CODECS, mean_codec_options, resolve


@dataclasses.dataclass(frozen=True)
class Codec:
    """How a round's pseudo-gradients travel: the codec of the contributions, its options, the
    codec of the mean sent back, and both error feedbacks. Checked when made; immutable; equal
    values are equal settings (peers of one run must agree: it is in the round manifest).

    ``rj.Swarm(codec=rj.Codec("sign", block_size=512, mean="int2"))``; ``rj.OuterSync`` reads
    ``swarm.codec``; ``rj.compress.simulated(codec)`` simulates the same value on one machine. A
    plain name (``codec="int8"``) stands for ``Codec("int8")``.

    Attributes:
      name: one of ``compress.CODECS`` (``"fp32"``, ``"bf16"``, ``"int8"``, ``"int4"``,
        ``"fp4"``, ``"int2"``, ``"sign"``, ``"topk"``; docs/compression.md has their bytes and
        errors).
      block_size: values per scale of a block codec (int8, int4, fp4, int2, sign; ``None``: the
        codec's default, 64 or 32 for fp4).
      fraction: topk's kept fraction in (0, 1] (``None``: 0.01).
      stochastic: stochastic rounding (bf16, int8, int4, fp4) with the round's key.
      mean: the codec of the mean the part owners send back (butterfly only; ``None``: ``name``):
        a block codec of the same block size, e.g. ``"sign"`` up and ``"int2"`` down.
      mean_ef: the part owners carry what their encode of the mean dropped into the next round
        (DoubleSqueeze, arXiv 1905.05957; butterfly only; off: on the char-LM it made ``sign``
        worse, docs/compression.md). Has no effect with ``fp32``.
      error_feedback: each peer carries what its encode dropped into its next contribution (the
        residual; arXiv 1901.09847). Lossy codecs only.
      error_feedback_decay: beta in ``[0, 1]``: the residual carried is ``beta * residual``
        (1.0: classic error feedback; SparseLoCo, arXiv 2508.15706, uses 0.95).
      seed: the PRNG seed of a swarm peer's stochastic rounding (``rj.OuterSync`` folds it with
        the exchange number; the simulation uses ``rj.diloco``'s ``rng_key``). Peer-local.

    Raises:
      ValueError: one line naming the bad field: an unknown codec, an option that does not
        apply to it or is out of range, a mean codec that does not pair with it, a non-bool
        flag, a decay outside ``[0, 1]``.
    """

    name: str = "fp32"
    block_size: int | None = None
    fraction: float | None = None
    stochastic: bool = False
    mean: str | None = None
    mean_ef: bool = False
    error_feedback: bool = True
    error_feedback_decay: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or self.name not in CODECS:
            raise ValueError(f"unknown codec {self.name!r}; available: {', '.join(CODECS)}")
        resolve(self.name, **self.options)  # ValueError naming the option
        for flag in ("mean_ef", "error_feedback"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"Codec.{flag} must be True or False, got {getattr(self, flag)!r}")
        decay = self.error_feedback_decay
        if isinstance(decay, bool) or not (isinstance(decay, (int, float)) and 0.0 <= decay <= 1.0):
            raise ValueError(f"error_feedback_decay must be a number in [0, 1], got {decay!r}")
        object.__setattr__(self, "error_feedback_decay", float(decay))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"Codec.seed must be an int, got {self.seed!r}")
        if self.mean == self.name:
            object.__setattr__(self, "mean", None)
        if self.mean is not None:  # ValueError: it does not pair with name, or takes no option
            resolve(self.mean, **mean_codec_options(self.name, self.mean, self.options))

    @classmethod
    def of(cls, value: Codec | str | None) -> Codec:
        """``value`` as a :class:`Codec`: itself, ``Codec(name)`` for a name, ``Codec("fp32")``
        for ``None``.

        Raises:
          TypeError: neither a Codec, a str nor None.
          ValueError: an unknown name.
        """
        if value is None:
            return cls()
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, Codec):
            return value
        raise TypeError(f"codec must be an rj.Codec or a codec name, got {type(value).__name__}")

    @property
    def options(self) -> dict[str, Any]:
        """The encode options set (``block_size``, ``fraction``, ``stochastic``), as keyword
        arguments of ``compress.encode`` / ``device_encode``."""
        opts = {"block_size": self.block_size, "fraction": self.fraction, "stochastic": bool(self.stochastic) or None}
        return {k: v for k, v in opts.items() if v is not None}

    @property
    def mean_name(self) -> str:
        """The codec of the mean sent back (``mean``, or ``name``)."""
        return self.mean or self.name

    @property
    def lossy(self) -> bool:
        """Whether the codec drops anything (everything but ``fp32``)."""
        return self.name != "fp32"

    def manifest(self) -> dict[str, Any]:
        """The settings every peer of a run must share, as JSON (the round manifest's ``codec``
        entries): the contributions' codec and options, the mean's codec and error feedback."""
        return {
            "codec": self.name,
            "codec_options": dict(sorted(self.options.items())),
            "mean_codec": self.mean_name,
            "mean_error_feedback": bool(self.mean_ef and self.lossy),
        }

    def __str__(self) -> str:
        # the options, then each of mean .. seed that is not at its default
        fields = [f"{k}={v!r}" for k, v in self.options.items()]
        fields += [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)[4:]
            if getattr(self, f.name) != f.default
        ]
        return f"Codec({', '.join([repr(self.name), *fields])})"
