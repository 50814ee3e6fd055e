"""The library's runtime: the driver that runs a strategy step by step (driver.py), `wrap()` for a
loop of your own (wrap.py) and the wiring both share (build.py).

Imports: strategies, engines, robust, contract, comm, errors -- never config,
cli, train or anything above (the library stops here).
"""
