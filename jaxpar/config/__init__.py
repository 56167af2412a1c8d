"""Configuration: the schema with its field domains, loading, command-line overrides.

One place per concern: each field's domain (type, range, allowed values) is checked here,
once; the rules that tie fields together and the batch arithmetic live in
:mod:`jaxpar.layout` (:meth:`ParallelLayout.validate`), which :func:`validate` calls, so the
rest of the code can trust a validated config. :func:`validate` is where a config becomes its
:class:`~jaxpar.layout.ParallelLayout`, once per run; the code below is handed that layout. Configs are ml_collections ``ConfigDict`` objects made of small
sub-configs (``mesh``, ``parallel``, ``model``, ``optim``, ``train``, ``data``,
``checkpoint``); code receives the sub-config it needs, never the whole tree. The layout's fields
are ``mesh.*`` and ``parallel.*``, named as :class:`~jaxpar.layout.ParallelLayout` names them; a key
from before they moved there (:data:`MOVED_KEYS`) is a one-line error naming the new key.

Errors are :class:`ConfigError`: one line that names the field and the fix. The CLI turns
them into exit code 2 without a traceback.

The modules: :mod:`~jaxpar.config.schema` (the fields and their defaults), :mod:`~jaxpar.config.moved`
(keys that moved and their error), :mod:`~jaxpar.config.loading` (files, overrides) and
:mod:`~jaxpar.config.validation` (field domains, then the layout). Every name is imported from here.
"""

from jaxpar.acts import flatten
from jaxpar.config.loading import (
    CONFIG_TIMEOUT_S,
    apply_overrides,
    config_file_values,
    load_config,
    load_config_and_layout,
    merge_into_defaults,
)
from jaxpar.config.moved import (
    MOVED_KEYS,
    REMOVED_SECTIONS,
    moved_key_error,
)
from jaxpar.config.schema import (
    DATA_SOURCES,
    DTYPES,
    FILE_SOURCES,
    MAX_DEVICES,
    MAX_DIM,
    MAX_PARAMS,
    ROPE_SCALINGS,
    SCHEDULE_TYPES,
    ConfigDict,
    default_config,
)
from jaxpar.config.validation import (
    ATTENTION_MASKS,
    PATH_FIELDS,
    validate,
    validate_rope_scaling,
)
from jaxpar.errors import ConfigError

__all__ = [
    "ATTENTION_MASKS",
    "CONFIG_TIMEOUT_S",
    "ConfigDict",
    "ConfigError",
    "DATA_SOURCES",
    "DTYPES",
    "FILE_SOURCES",
    "MAX_DEVICES",
    "MAX_DIM",
    "MAX_PARAMS",
    "MOVED_KEYS",
    "PATH_FIELDS",
    "REMOVED_SECTIONS",
    "ROPE_SCALINGS",
    "SCHEDULE_TYPES",
    "apply_overrides",
    "config_file_values",
    "default_config",
    "flatten",
    "load_config",
    "load_config_and_layout",
    "merge_into_defaults",
    "moved_key_error",
    "validate",
    "validate_rope_scaling",
]
