"""The ``mixprec`` command line: it parses arguments and calls the library, nothing more."""
