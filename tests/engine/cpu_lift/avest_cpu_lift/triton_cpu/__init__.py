"""A Triton backend named ``cpu`` that compiles nothing (kernels run in the interpreter)."""
