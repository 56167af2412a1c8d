"""How the mesh axes split the work: ZeRO over ``data``, Megatron tensor parallelism over ``tensor``,
the pipeline over ``pipeline`` (schedule tables, stage forms, executor)."""
