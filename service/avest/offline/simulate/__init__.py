"""``avest simulate``: what adaptive verification buys at each concurrency.

- :mod:`.engine`: the simulation loop and its policies;
- :mod:`.profiles`: step-cost profiles (``avest-costs/1``);
- :mod:`.results`: policies' results; :mod:`.report`: tables and plots.
"""
