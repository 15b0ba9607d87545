"""The cluster-profile schema: everything machine-specific, so that a job YAML never is."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints, model_validator

from hpcrl.config.base import NonNegativeInt, PositiveFloat, PositiveInt, SafeName, Schema

# Values that reach the batch script. They are quoted when rendered, and validated here as well so
# that a typo fails at load time rather than at sbatch time.
SlurmToken = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._,:@+-]*$")]
TimeLimit = Annotated[str, StringConstraints(pattern=r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$")]
Memory = Annotated[str, StringConstraints(pattern=r"^\d+[KMGT]?$")]
Signal = Annotated[str, StringConstraints(pattern=r"^(B:)?(USR1|USR2|TERM|INT|HUP)(@\d+)?$")]
EnvName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
ModuleName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._/+-]*$")]
SbatchFlag = Annotated[str, StringConstraints(pattern=r"^--[a-z][a-z-]*(=[A-Za-z0-9._,:@/+=-]+)?$")]


class SlurmSettings(Schema):
    """How to ask Slurm for the allocation and start the MPI world inside it."""

    partition: SlurmToken | None = None
    account: SlurmToken | None = None
    qos: SlurmToken | None = None
    time: TimeLimit = "01:00:00"
    cpus_per_task: PositiveInt = 1
    mem_per_cpu: Memory | None = None
    mem: Memory | None = Field(None, description="memory per node, e.g. 480G")
    signal: Signal = Field("B:USR1@300", description="warning signal before the time limit")
    mpi: Literal["pmix", "pmi2", "none"] = "pmi2"
    launcher: Literal["srun", "mpiexec"] = Field("srun", description="what starts the ranks inside the allocation")
    modules: list[ModuleName] = []
    env: dict[EnvName, str] = {}
    container_image: str | None = None
    container_mounts: list[str] = []
    python: str = Field("python3", description="interpreter with hpcrl installed, as seen on the compute nodes")
    extra_flags: list[SbatchFlag] = []


class ClusterProfile(Schema):
    """A machine room: node count, devices, memory, and (for Slurm) how to request them."""

    name: SafeName
    scheduler: Literal["local", "slurm"]
    nodes: PositiveInt
    devices_per_node: PositiveInt
    device: Literal["cpu", "cuda"]
    device_memory_gb: PositiveFloat
    max_restarts: NonNegativeInt = Field(0, description="automatic restarts from the last checkpoint after a failure")
    slurm: SlurmSettings | None = None

    @model_validator(mode="after")
    def _slurm_section(self) -> "ClusterProfile":
        if self.scheduler == "slurm" and self.slurm is None:
            raise ValueError("scheduler is 'slurm' but the 'slurm' section is missing (partition, time, ...)")
        return self

    @property
    def slots(self) -> int:
        return self.nodes * self.devices_per_node
