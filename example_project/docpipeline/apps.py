from django.apps import AppConfig


class DocPipelineConfig(AppConfig):
    name = "example_project.docpipeline"
    label = "docpipeline"
    verbose_name = "Document pipeline demo"
