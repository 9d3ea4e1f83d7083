"""3D Slicer markups (.fcsv, .mrk.json): RAS/LPS handling, round trips, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
from bundle.data.datalist import DatalistError
from bundle.data.markups import ControlPoint, markups_stem, read_fcsv, read_markups, read_mrk_json, write_markups

POINTS = [
    ControlPoint("sella", (12.5, -40.25, 7.0)),
    ControlPoint("nasion", (-3.125, 60.0, -2.5)),
    ControlPoint("a, b", (0.1, 0.2, 0.3)),  # a label with a comma survives the CSV quoting
]
FCSV_HEADER = (
    "# Markups fiducial file version = {version}\n# CoordinateSystem = {system}\n"
    "# columns = id,x,y,z,ow,ox,oy,oz,vis,sel,lock,label,desc,associatedNodeID\n"
)


def positions(points: list[ControlPoint]) -> np.ndarray:
    return np.array([p.position for p in points], dtype=float)


@pytest.mark.parametrize("suffix", [".mrk.json", ".fcsv"])
def test_ras_round_trip(tmp_path, suffix):
    path = write_markups(tmp_path / f"a{suffix}", POINTS, "RAS")
    back = read_markups(path)
    assert [p.label for p in back] == [p.label for p in POINTS]
    np.testing.assert_array_equal(positions(back), positions(POINTS))


@pytest.mark.parametrize("suffix", [".mrk.json", ".fcsv"])
def test_lps_file_stores_negated_x_y_and_reads_back_as_ras(tmp_path, suffix):
    path = write_markups(tmp_path / f"a{suffix}", POINTS, "LPS")
    text = path.read_text()
    if suffix == ".fcsv":
        assert "# CoordinateSystem = LPS" in text
        rows = [line.split(",") for line in text.splitlines() if not line.startswith("#")]
        stored = np.array([[float(v) for v in row[1:4]] for row in rows])
    else:
        markup = json.loads(text)["markups"][0]
        assert markup["coordinateSystem"] == "LPS"
        stored = np.array([cp["position"] for cp in markup["controlPoints"]])
    expected = positions(POINTS) * np.array([-1.0, -1.0, 1.0])
    np.testing.assert_array_equal(stored, expected)
    np.testing.assert_array_equal(positions(read_markups(path)), positions(POINTS))


def test_fcsv_and_mrk_json_agree(tmp_path):
    a = read_markups(write_markups(tmp_path / "p.fcsv", POINTS, "LPS"))
    b = read_markups(write_markups(tmp_path / "p.mrk.json", POINTS, "RAS"))
    assert a == b


def test_mrk_json_is_a_valid_slicer_point_list(tmp_path):
    path = write_markups(tmp_path / "p.mrk.json", POINTS + [ControlPoint("menton", None)], "RAS")
    data = json.loads(path.read_text())
    assert isinstance(data["@schema"], str) and data["@schema"].startswith("https://")
    assert data["@schema"].endswith(".json#")
    markup = data["markups"][0]
    assert (markup["type"], markup["coordinateSystem"], markup["coordinateUnits"]) == ("Fiducial", "RAS", "mm")
    cps = markup["controlPoints"]
    assert [cp["id"] for cp in cps] == ["1", "2", "3", "4"]
    assert all(cp["positionStatus"] == "defined" and len(cp["position"]) == 3 for cp in cps[:3])
    assert cps[3]["positionStatus"] == "undefined" and "position" not in cps[3]
    back = read_markups(path)
    assert back[3] == ControlPoint("menton", None)


def test_fcsv_cannot_store_unplaced_points(tmp_path):
    with pytest.warns(UserWarning, match="menton"):
        path = write_markups(tmp_path / "p.fcsv", POINTS + [ControlPoint("menton", None)])
    assert [p.label for p in read_markups(path)] == [p.label for p in POINTS]


@pytest.mark.parametrize(("system", "sign"), [("LPS", -1.0), ("1", -1.0), ("RAS", 1.0), ("0", 1.0)])
def test_slicer_written_fcsv(tmp_path, system, sign):
    text = FCSV_HEADER.format(version="4.11", system=system)
    text += "vtkMRMLMarkupsFiducialNode_0,-1.5,2.25,3,0,0,0,1,1,1,0,F-1,,vtkMRMLScalarVolumeNode1\n"
    text += "vtkMRMLMarkupsFiducialNode_1,10,-20,30,0,0,0,1,1,1,0,F-2,,\n"
    path = tmp_path / "slicer.fcsv"
    path.write_text(text)
    got = read_fcsv(path)
    assert [p.label for p in got] == ["F-1", "F-2"]
    np.testing.assert_array_equal(positions(got), [[-1.5 * sign, 2.25 * sign, 3.0], [10.0 * sign, -20.0 * sign, 30.0]])


def test_fcsv_without_coordinate_line_is_ras_and_columns_line_is_followed(tmp_path):
    path = tmp_path / "old.fcsv"
    path.write_text("# columns = label,z,y,x\nA,3,2,1\n")
    assert read_fcsv(path) == [ControlPoint("A", (1.0, 2.0, 3.0))]


def test_mrk_json_defaults_to_lps_and_converts_micrometres(tmp_path):
    path = tmp_path / "x.mrk.json"
    path.write_text(
        json.dumps(
            {
                "@schema": "s",
                "markups": [
                    {"type": "Fiducial", "controlPoints": [{"label": "a", "position": [1, 2, 3]}]},
                    {
                        "type": "Fiducial",
                        "coordinateSystem": "RAS",
                        "coordinateUnits": "um",
                        "controlPoints": [{"label": "b", "position": [1000, 2000, 3000]}],
                    },
                ],
            }
        )
    )
    assert read_mrk_json(path) == [ControlPoint("a", (-1.0, -2.0, 3.0)), ControlPoint("b", (1.0, 2.0, 3.0))]


def test_mrk_json_non_point_markups_are_ignored_with_a_warning(tmp_path):
    path = tmp_path / "x.mrk.json"
    line = {"type": "Line", "controlPoints": [{"label": "l", "position": [0, 0, 0]}]}
    path.write_text(json.dumps({"markups": [line]}))
    with pytest.warns(UserWarning, match="Line"):
        assert read_mrk_json(path) == []


def test_bad_input_names_the_file(tmp_path):
    corrupt = tmp_path / "c.mrk.json"
    corrupt.write_text("{not json")
    with pytest.raises(DatalistError, match="c.mrk.json"):
        read_markups(corrupt)
    short = tmp_path / "s.mrk.json"
    short.write_text(
        json.dumps(
            {
                "markups": [
                    {
                        "type": "Fiducial",
                        "controlPoints": [{"label": "a", "position": [0, 0, 0]}, {"label": "b", "position": [0, 0]}],
                    }
                ]
            }
        )
    )
    with pytest.raises(DatalistError, match=r"s.mrk.json: markups\[0\].controlPoints\[1\] \('b'\).position"):
        read_markups(short)
    system = tmp_path / "w.mrk.json"
    system.write_text(json.dumps({"markups": [{"type": "Fiducial", "coordinateSystem": "XYZ"}]}))
    with pytest.raises(DatalistError, match="coordinateSystem"):
        read_markups(system)
    text_bad = tmp_path / "b.fcsv"
    rows = "0,1,2,3,0,0,0,1,1,1,0,A,,\n1,1,oops,3,0,0,0,1,1,1,0,B,,\n"
    text_bad.write_text(FCSV_HEADER.format(version="4.11", system="RAS") + rows)
    with pytest.raises(DatalistError, match=r"b.fcsv:5"):
        read_markups(text_bad)
    unknown = tmp_path / "u.fcsv"
    unknown.write_text(FCSV_HEADER.format(version="4.11", system="IJK"))
    with pytest.raises(DatalistError, match=r"u.fcsv:2.*IJK"):
        read_markups(unknown)
    with pytest.raises(DatalistError, match="not found"):
        read_markups(tmp_path / "absent.fcsv")
    with pytest.raises(ValueError, match="coordinate_system"):
        write_markups(tmp_path / "p.fcsv", POINTS, "IJK")
    with pytest.raises(ValueError, match="unknown markups format"):
        write_markups(tmp_path / "p.csv", POINTS)
    with pytest.raises(ValueError, match="sella"):
        write_markups(tmp_path / "p.mrk.json", [ControlPoint("sella", (0.0, float("nan"), 1.0))])


def test_markups_stem():
    assert markups_stem("dir/case_01.mrk.json") == "case_01"
    assert markups_stem("case.02.fcsv") == "case.02"
    assert markups_stem("case.nii.gz") is None
