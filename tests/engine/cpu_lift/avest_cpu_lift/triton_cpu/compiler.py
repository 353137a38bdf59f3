"""The ``cpu`` target: accepted, never compiled (``TRITON_INTERPRET=1`` runs kernels)."""

from triton.backends.compiler import BaseBackend, GPUTarget


class InterpreterOnlyBackend(BaseBackend):
    @staticmethod
    def supports_target(target: GPUTarget) -> bool:
        return target.backend == "cpu"

    def hash(self) -> str:
        return "avest-cpu-lift-interpreter"

    def parse_options(self, options: dict) -> object:
        return options

    def add_stages(self, stages: dict, options: object, language: object) -> None:
        raise RuntimeError("the avest-cpu-lift backend compiles nothing: set TRITON_INTERPRET=1")

    def load_dialects(self, context: object) -> None:
        return None

    def get_module_map(self) -> dict:
        return {}
