"""Built-in backends, installed as ``kvtier.backends``.

They are found through the ``kvtier.backends`` entry-point group exactly as a third-party
plugin is; the core never imports these modules by name.
"""
