"""Reports: the model card (HTML, PDF), the dashboard and the generated interface document."""
from __future__ import annotations

from atdnode.face import lazy_face

# The names other rooms, the CLI and netsim import from here (atdnode/face.py).
_FACE = {"collect_card": "card:collect", "write_card_html": "card_html:write", "PdfError": "card_pdf",
         "print_pdf": "card_pdf", "Dashboard": "dashboard.server", "check_free": "dashboard.server",
         "parse_bind": "dashboard.server", "card_statement": "card"}
__all__ = [*_FACE]
__getattr__, __dir__ = lazy_face(__name__, _FACE)
