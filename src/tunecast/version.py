"""Version of the package and of the JSON documents it prints."""

__version__ = "0.1.0"

# Bumped whenever a JSON document's keys change incompatibly; every document carries it.
SCHEMA_VERSION = 1
