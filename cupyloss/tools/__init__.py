"""Commands that maintain the library rather than run it.

    python -m cupyloss.tools.precompile   compile every kernel into the kernel cache up front
    python -m cupyloss.tools.tune         measure a GPU's row of the launch table
    python -m cupyloss.tools.stubs        write cupyloss/torch/__init__.pyi from cupyloss.torch as built
"""
