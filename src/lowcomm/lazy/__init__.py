"""A package's public names imported on first use (PEP 562, exports.py): lowcomm's face, config/ and
data/ each declare which module defines each name, and `lowcomm --help` or `lowcomm data prepare`
import none of the modules that load torch until a name that needs them is asked for.

Imports: nothing. Every folder may import it.
"""
