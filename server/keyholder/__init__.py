"""The key holder: the only owner of the secret key, the global model and its optimizer."""

from server.keyholder.keyholder import KeyHolder
from server.keyholder.keyholder_servicer import KeyHolderServicer
from server.keyholder.keyholder_settings import KeyHolderSettings

__all__ = ["KeyHolder", "KeyHolderServicer", "KeyHolderSettings"]
