"""The package's version, in a module of its own.

``stacktools.__version__`` is this; a module of the package that needs the
version (the plan cache keys on it) reads it here rather than importing the
package's ``__init__``, which imports every module.
"""

__version__ = "0.1.0"
