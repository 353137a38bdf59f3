"""An always-active driver whose target is the CPU and whose device is ``torch.device("cpu")``."""

from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase


class InterpreterOnlyDriver(DriverBase):
    @classmethod
    def is_active(cls) -> bool:
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("the avest-cpu-lift driver launches nothing")

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cpu", 0, 0)

    def get_active_torch_device(self):  # noqa: ANN201
        import torch

        return torch.device("cpu")

    def get_current_device(self) -> int:
        return 0

    def get_benchmarker(self):  # noqa: ANN201
        raise NotImplementedError("the avest-cpu-lift driver benchmarks nothing")
