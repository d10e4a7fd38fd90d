"""Reports: the model card (HTML, PDF), the dashboard and the generated interface document."""
