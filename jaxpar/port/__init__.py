"""Importers for PyTorch training recipes (DeepSpeed, Megatron-LM, torchtitan, FSDP/accelerate).

Each ``port_*`` function returns ``(ConfigDict, Report)``; the report says what became of every
source setting. The entry points: :func:`jaxpar.port.recipe.port_recipe` (any kind, written as a
config file), :func:`jaxpar.port.deepspeed.port_deepspeed`, :func:`jaxpar.port.megatron.port_megatron`,
:func:`jaxpar.port.torchtitan.port_torchtitan`, :func:`jaxpar.port.fsdp.port_fsdp`, and the Hugging Face
weights in :mod:`jaxpar.port.weights`. Megatron launch scripts are read by :mod:`jaxpar.port.bash`.
"""
