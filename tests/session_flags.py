"""The XLA flags the test session sets (tests/conftest.py) and the tests that undo them read
(tests/helpers.py), in one place. Importing this module imports no JAX."""

# LLVM's optimisation level for the code XLA:CPU emits (0 in the test session)
LLVM_LEVEL = "--xla_backend_optimization_level"
# XLA:CPU's fusion emitters; "=false" switches to its elemental emitter (jax 0.10's XLA only)
FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters"
ELEMENTAL_EMITTER = f"{FUSION_EMITTERS}=false"
