"""How a pipeline splits the transformer layers over its stages, as Megatron-Core does.

Three ways (``parallelism.*``):

* even: every stage holds ``num_layers / PP`` layers;
* uneven first/last stage (``layers_in_first_stage`` / ``layers_in_last_stage``, Megatron-Core's
  ``num_layers_in_first/last_pipeline_stage``): the named stages hold what they are given, the
  middle stages split the rest evenly (Llama 3 405B: 126 layers, PP=16, 7 + 14 x 8 + 7);
* the embedding and/or the loss counted as a layer (``account_for_embedding_in_pipeline_split``,
  ``account_for_loss_in_pipeline_split``): ``(num_layers + 1 [+ 1]) / PP`` per stage, the first
  (last) stage building one transformer layer fewer.

With virtual stages (VPP) each stage's layers split evenly over its VPP model chunks.
:func:`split_problems` says why a split cannot be built (every factor, with the fix);
:func:`stage_layers` gives the layers of every stage of a valid one, :func:`stage_layer_numbers`
which they are.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from launcher.core.problems import Problem, divisors, fmt_values

KEYS = ("parallelism.layers_in_first_stage", "parallelism.layers_in_last_stage",
        "parallelism.account_for_embedding_in_pipeline_split",
        "parallelism.account_for_loss_in_pipeline_split")
"""The config keys of the stage split."""


@dataclass(frozen=True)
class StageSplit:
    """The stage split settings of ``parallelism`` (see the module docstring)."""

    first: int = 0
    """Layers of the first stage; 0 = an even share."""
    last: int = 0
    """Layers of the last stage; 0 = an even share."""
    embedding: bool = False
    """The embedding counts as one layer of the first stage."""
    loss: bool = False
    """The output layer and loss count as one layer of the last stage."""

    @classmethod
    def of(cls, parallelism) -> "StageSplit":
        p = parallelism
        return cls(p.layers_in_first_stage, p.layers_in_last_stage,
                   p.account_for_embedding_in_pipeline_split,
                   p.account_for_loss_in_pipeline_split)

    @property
    def uneven(self) -> bool:
        """Any setting other than the even split."""
        return bool(self.first or self.last or self.embedding or self.loss)

    def overrides(self) -> list[str]:
        """The command-line overrides that select this split (none for the even one)."""
        out = []
        if self.first:
            out.append(f"parallelism.layers_in_first_stage={self.first}")
        if self.last:
            out.append(f"parallelism.layers_in_last_stage={self.last}")
        if self.embedding:
            out.append("parallelism.account_for_embedding_in_pipeline_split=true")
        if self.loss:
            out.append("parallelism.account_for_loss_in_pipeline_split=true")
        return out


def _raw_layers(num_layers: int, pp: int, split: StageSplit) -> tuple[list[int], int]:
    """(layers per stage, the per-stage divisor that had to divide evenly), possibly invalid."""
    if split.first or split.last:
        named = (1 if split.first else 0) + (1 if split.last else 0)
        middle_stages = pp - named
        rest = num_layers - split.first - split.last
        middle = rest // middle_stages if middle_stages > 0 else 0
        layers = [middle] * pp
        if split.first:
            layers[0] = split.first
        if split.last:
            layers[-1] = split.last
        return layers, middle
    extra = int(split.embedding) + int(split.loss)
    per = (num_layers + extra) // pp
    layers = [per] * pp
    layers[0] -= int(split.embedding)
    layers[-1] -= int(split.loss)
    return layers, per


def stage_layers(num_layers: int, pp: int, split: StageSplit = StageSplit()) -> tuple[int, ...]:
    """Transformer layers of every pipeline stage (summed over its virtual chunks); assumes
    :func:`split_problems` found none."""
    if pp == 1:
        return (num_layers,)
    return tuple(_raw_layers(num_layers, pp, split)[0])


@functools.lru_cache(maxsize=4096)
def stage_layer_numbers(num_layers: int, pp: int, vpp: int = 1,
                        split: StageSplit = StageSplit()) -> tuple[tuple[int, ...], ...]:
    """The transformer layers (numbered from 0) of every pipeline stage, first to last, as
    Megatron-Core places them (``get_transformer_layer_offset``): the model cut into VPP rounds,
    each round into one chunk per stage in stage order, a stage holding its chunk of every
    round; the embedding (loss) counted as a layer takes the place of one in the first (last)
    chunk of all. Assumes :func:`split_problems` found none. Cached: a layout search asks
    for the same few splits tens of thousands of times."""
    if pp == 1:
        return (tuple(range(num_layers)),)
    counts = _raw_layers(num_layers, pp, split)[0]
    rounds = [[n // vpp for n in counts] for _ in range(vpp)]
    if vpp > 1 and (split.embedding or split.loss):
        per = (num_layers + int(split.embedding) + int(split.loss)) // (pp * vpp)
        rounds = [[per] * pp for _ in range(vpp)]
        rounds[0][0] -= int(split.embedding)
        rounds[-1][-1] -= int(split.loss)
    stages: list[list[int]] = [[] for _ in range(pp)]
    start = 0
    for chunks in rounds:
        for stage, n in enumerate(chunks):
            stages[stage].extend(range(start, start + n))
            start += n
    return tuple(tuple(s) for s in stages)


def split_problems(num_layers: int, pp: int, vpp: int, split: StageSplit) -> list[Problem]:
    """Why ``split`` cannot put ``num_layers`` layers on ``pp`` stages of ``vpp`` chunks."""
    if not split.uneven:
        return _even_problems(num_layers, pp, vpp)
    if pp == 1:
        return [Problem(KEYS + ("parallelism.pipeline_parallel_size",),
                        f"{', '.join(split.overrides())} needs pipeline_parallel_size > 1 (got "
                        "1); unset it, or raise parallelism.pipeline_parallel_size")]
    if (split.first or split.last) and (split.embedding or split.loss):
        return [Problem(KEYS, "parallelism.layers_in_first_stage / layers_in_last_stage cannot "
                              "be combined with account_for_embedding_in_pipeline_split / "
                              "account_for_loss_in_pipeline_split (Megatron-Core refuses it); "
                              "use one way of splitting")]
    if split.first or split.last:
        return _uneven_problems(num_layers, pp, vpp, split)
    return _accounted_problems(num_layers, pp, vpp, split)


def _even_problems(num_layers: int, pp: int, vpp: int) -> list[Problem]:
    stages = pp * vpp
    if num_layers % stages == 0:
        return []
    return [Problem(
        ("model.num_layers", "parallelism.pipeline_parallel_size",
         "parallelism.virtual_pipeline_parallel_size"),
        f"model.num_layers={num_layers} is not divisible by pipeline_parallel_size x "
        f"virtual_pipeline_parallel_size = {pp} x {vpp} = {stages}; use a product from "
        f"{fmt_values(divisors(num_layers))}" + _uneven_hint(num_layers, pp, vpp))]


def _uneven_hint(num_layers: int, pp: int, vpp: int) -> str:
    """The uneven splits that would place ``num_layers`` on ``pp`` stages, for the message."""
    hint = _ends_hint(num_layers, pp, vpp)
    if (num_layers + 2) % (pp * vpp) == 0 and (num_layers + 2) // (pp * vpp) >= 2:
        hint += (f", or count the embedding and the loss as layers: parallelism."
                 f"account_for_embedding_in_pipeline_split=true parallelism."
                 f"account_for_loss_in_pipeline_split=true ({num_layers} + 2 = "
                 f"{pp} x {(num_layers + 2) // pp})")
    return hint


def _ends_hint(num_layers: int, pp: int, vpp: int) -> str:
    """', or give the first and last stages fewer layers: ...' when such a split exists (equal
    ends, else, without virtual stages, the last one layer fewer: a prime layer count)."""
    if pp < 2:
        return ""
    middle = -(-num_layers // pp) if pp > 2 else 0
    while middle > 0:
        ends = num_layers - (pp - 2) * middle
        if ends >= 2 * vpp and ends % 2 == 0 and (ends // 2) % vpp == 0 and middle % vpp == 0:
            return _ends_text(num_layers, pp, ends // 2, middle, ends // 2)
        middle -= 1
    middle = -(-num_layers // pp) if pp > 2 else 0
    ends = num_layers - (pp - 2) * middle
    if vpp > 1 or ends < 2:
        return ""
    return _ends_text(num_layers, pp, ends - ends // 2, middle, ends // 2)


def _ends_text(num_layers: int, pp: int, first: int, middle: int, last: int) -> str:
    inner = f" + {pp - 2} x {middle}" if pp > 2 else ""
    what = "give the first and last stages fewer layers" if pp > 2 else "split them unevenly"
    return (f", or {what}: "
            f"parallelism.layers_in_first_stage={first} "
            f"parallelism.layers_in_last_stage={last} ({first}{inner} + {last} = {num_layers})")


def _uneven_problems(num_layers: int, pp: int, vpp: int, split: StageSplit) -> list[Problem]:
    named = (1 if split.first else 0) + (1 if split.last else 0)
    middle_stages = pp - named
    rest = num_layers - split.first - split.last
    given = f"layers_in_first_stage={split.first}, layers_in_last_stage={split.last}"
    problems = []
    if split.first < 0 or split.last < 0:
        problems.append(Problem(KEYS[:2], f"parallelism.{given}: both must be >= 0 (0 = an even "
                                          "share)"))
    elif rest < 0 or (middle_stages == 0 and rest != 0) or (middle_stages > 0 and rest <= 0):
        problems.append(Problem(
            KEYS[:2] + ("model.num_layers", "parallelism.pipeline_parallel_size"),
            f"parallelism.{given} leave {rest} of model.num_layers={num_layers} layers for "
            f"{middle_stages} other stage(s) of pipeline_parallel_size={pp}; every stage needs "
            "at least one layer and the stages must hold every layer"))
    elif middle_stages and rest % middle_stages:
        problems.append(Problem(
            KEYS[:2] + ("model.num_layers", "parallelism.pipeline_parallel_size"),
            f"model.num_layers={num_layers} minus parallelism.{given} leaves {rest} layers, not "
            f"divisible by the {middle_stages} middle stages (pipeline_parallel_size={pp} minus "
            f"{named}); choose first + last so that {num_layers} - first - last is a multiple "
            f"of {middle_stages}"))
    if not problems and vpp > 1:
        layers, middle = _raw_layers(num_layers, pp, split)
        bad = sorted({n for n in layers if n % vpp})
        if bad:
            problems.append(Problem(
                KEYS[:2] + ("parallelism.virtual_pipeline_parallel_size",),
                f"stage layer counts {fmt_values(bad)} (parallelism.{given}, {middle} per middle "
                f"stage) are not divisible by virtual_pipeline_parallel_size={vpp}; every "
                "stage's layers split evenly over its virtual chunks"))
    return problems


def _accounted_problems(num_layers: int, pp: int, vpp: int, split: StageSplit) -> list[Problem]:
    extra = int(split.embedding) + int(split.loss)
    total = num_layers + extra
    what = " + ".join(["model.num_layers"] + ["embedding"] * split.embedding
                      + ["loss"] * split.loss)
    if total % (pp * vpp):
        return [Problem(
            KEYS[2:] + ("model.num_layers", "parallelism.pipeline_parallel_size",
                        "parallelism.virtual_pipeline_parallel_size"),
            f"{what} = {num_layers} + {extra} = {total} is not divisible by "
            f"pipeline_parallel_size x virtual_pipeline_parallel_size = {pp} x {vpp} = "
            f"{pp * vpp} (account_for_embedding/loss_in_pipeline_split count them as layers); "
            f"use a product from {fmt_values(divisors(total))}")]
    if total // (pp * vpp) < 2 and extra:
        return [Problem(
            KEYS[2:] + ("parallelism.pipeline_parallel_size",
                        "parallelism.virtual_pipeline_parallel_size"),
            f"{what} = {total} over {pp} x {vpp} chunks leaves the first/last chunk without a "
            "transformer layer; use fewer pipeline stages or virtual stages")]
    return []
