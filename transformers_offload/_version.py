"""The package version, written into every recording manifest (`created_by`)."""

__version__ = "0.1.0"
