"""fastddp's version, in a module of its own: the package and its modules read it from here."""

__version__ = "0.1.0"
