"""Seeing what the tokens do: cluster maps, redundancy per layer and reconstruction error by method."""

from pipeline.analysis.clustermap import cluster_maps, patch_groups, render_map
from pipeline.analysis.probe import (
    AnalysisError,
    Subject,
    beton_images,
    block_records,
    load_subject,
    read_images,
    with_method,
)
from pipeline.analysis.reconstruction import nn_error, plot_reconstruction, reconstruction_rows
from pipeline.analysis.redundancy import clusters_needed, mean_cosine, plot_redundancy, redundancy_rows

__all__ = [
    "AnalysisError",
    "Subject",
    "beton_images",
    "block_records",
    "cluster_maps",
    "clusters_needed",
    "load_subject",
    "mean_cosine",
    "nn_error",
    "patch_groups",
    "plot_reconstruction",
    "plot_redundancy",
    "read_images",
    "reconstruction_rows",
    "redundancy_rows",
    "render_map",
    "with_method",
]
