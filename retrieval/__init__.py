"""Retrieval structures for tree drafting: suffix automata, an n-gram index and a top-k successor table behind one
:class:`Retriever` interface, plus corpus datastores and a store of finished outputs kept in one across restarts.
Imports neither vLLM nor torch (numpy, numba, msgspec only)."""

from .datastore import Datastore, DatastoreError, build_datastore, check_datastore, load_datastore
from .ngram import NgramIndex
from .sam import StaticSuffixAutomaton, SuffixAutomaton
from .store import GlobalSuffixStore, NgramRetriever, Retriever, SuccessorRetriever, SuffixRetriever
from .store_file import StoreFile
from .successor import SuccessorTable
from .tree import SEP, RetrievedTree, TreeUnion, extract_tree, merge_trees, union_trees

__all__ = [
    "SEP", "Datastore", "DatastoreError", "GlobalSuffixStore", "NgramIndex", "NgramRetriever", "RetrievedTree",
    "Retriever", "StaticSuffixAutomaton", "StoreFile", "SuccessorRetriever", "SuccessorTable", "SuffixAutomaton",
    "SuffixRetriever", "TreeUnion", "build_datastore", "check_datastore", "extract_tree", "load_datastore",
    "merge_trees", "union_trees",
]
