"""Every case of the contract suite runs its engine calls under a grad mode (``tests/conftest.py``:
plain, ``torch.no_grad()`` or ``torch.inference_mode()``); ``World`` allocates its pools and tables
outside it, as SGLang's model runner does at start-up."""

import pytest


@pytest.fixture(autouse=True)
def _engine_calls_in_a_grad_mode(engine_grad_mode):
    yield
