"""The base of every schema: strict (unknown keys are errors) and immutable once loaded."""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

PositiveInt = Annotated[int, Field(strict=True, gt=0)]
NonNegativeInt = Annotated[int, Field(strict=True, ge=0)]
# Floats are finite: an lr or a coefficient of inf or nan would only fail steps into the run.
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
UnitInterval = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
# torch.manual_seed takes seeds below 2**63 (hpcrl derives per-round seeds from it modulo 2**63).
Seed = Annotated[int, Field(strict=True, ge=0, lt=2**63)]
# Names end up in paths, Slurm job names and shell scripts: letters, digits, '.', '_' and '-' only.
SafeName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]


class Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
